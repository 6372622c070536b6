import os
import sys

# tests/ holds helper modules (onnx_suites) imported by the test files.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
