"""`python -m ember.native MODEL -o DIR`: the `ember convert` command."""
import sys

from ember.native.convert import main

sys.exit(main())
