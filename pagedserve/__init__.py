"""pagedserve: disaggregated LLM serving over gRPC with a paged KV cache."""

import sys
from pathlib import Path

__version__ = "0.1.0"


def _leave_the_checkout_off_sys_path() -> None:
    """Drop a source checkout's root from `sys.path` (docs/architecture.md).

    The checkout's top-level folders (`kernels/`, `model/`, `router/` ...) are sub-packages of
    `pagedserve`, never import roots. `python -m pagedserve...` or `python -c` started in the
    checkout puts its root first on `sys.path`, where `kernels/` hides Hugging Face's `kernels`
    package, which transformers >= 5.25 imports on its own import. An installed wheel has no
    checkout (its `pagedserve/kernels` is a folder, not the checkout's link), so nothing changes.
    """
    package = Path(__file__).resolve().parent
    if not (package / "kernels").is_symlink():
        return
    checkout = package.parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != checkout]


_leave_the_checkout_off_sys_path()
