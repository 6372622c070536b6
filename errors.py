"""ember's exception types. Every error a user can cause derives from EmberError,
so the CLI can turn it into one line and exit code 2."""


class EmberError(Exception):
    """Base of every error ember raises on purpose."""


class ModelLoadError(EmberError):
    """The model file could not be read or parsed (corrupt, truncated, unsafe paths)."""


class UnsupportedOpError(EmberError):
    """The model uses ops ember has no implementation for; lists all of them."""

    def __init__(self, missing: list[tuple[str, str, int]], backend: str = "cpu"):
        self.missing = sorted(set(missing))
        listed = ", ".join(f"{d or 'ai.onnx'}::{op}-{v}" for d, op, v in self.missing)
        super().__init__(
            f"{len(self.missing)} unsupported op(s) on backend '{backend}': {listed}"
        )


class InvalidModelError(EmberError):
    """The model is structurally wrong (bad attribute, undefined value, ...)."""


class InputError(EmberError):
    """A feed given to run() does not match what the model declares."""


class BadRowError(InputError):
    """A row of a batch-inference dataset (`ember batch`) does not fit the model; names the
    file, the row (its index within the file) and the column."""

    def __init__(self, path: str, row: int, problem: str,
                 hint: str = "--on-error skip sets failing rows aside in an errors file and "
                             "carries on"):
        self.path, self.row, self.problem = path, row, problem
        super().__init__(f"{path}, row {row}, {problem}" + (f" ({hint})" if hint else ""))


class ExecutionError(EmberError):
    """A kernel failed while running a node; names the node."""


class BackendUnavailableError(EmberError):
    """The requested backend cannot be used on this machine."""


class ResourceLimitError(ExecutionError):
    """A node asked for a tensor larger than the session's `max_tensor_bytes` (ember.limits)."""
