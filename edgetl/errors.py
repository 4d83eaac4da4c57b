"""User-facing errors: bad input that the CLI reports in one line with exit code 2."""


class EdgetlError(Exception):
    """Base for errors caused by the user's input or environment, not by a bug."""


class ConfigError(EdgetlError, ValueError):
    """A value, option or recipe key is not allowed; the message names it and what is allowed."""


class DataError(EdgetlError):
    """Data is missing or laid out wrongly."""


class CapabilityError(EdgetlError):
    """A requested feature is impossible here (no GPU, no TensorRT, ...)."""


class BudgetError(EdgetlError):
    """A configuration does not fit the memory budget."""


class ResourceError(EdgetlError):
    """The machine lacks what a run needs: disk space, a writable file, memory for a data worker."""


class DivergedError(EdgetlError):
    """Training produced a non-finite loss or non-finite weights; nothing non-finite was saved."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """``exc`` as one line for a summary or a report row: its type and its message, whitespace
    folded, the message cut at ``limit`` characters."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:limit]}"
