"""Work-arounds for vLLM behaviour that breaks the testbed's in-process engines.

:func:`kernel_scan_safe`: at worker start, vLLM 0.32 on CPU rebinds its Triton kernels by
scanning the attributes of every loaded module and calling ``vars()`` on each one that has a
``__dict__`` (``vllm.triton_utils.dispatcher._rebind_kernels``). llvmlite's ``ffi.lib``
(loaded with numba, which the what-if analysis uses) answers *any* attribute, ``__dict__``
included, with a C function wrapper, so the scan raises ``AttributeError`` and the engine
never starts, in any process that ran a what-if before building a ``vllm.LLM``. While vLLM
starts, such objects are taken out of the module namespaces and put back afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def kernel_scan_safe() -> Iterator[None]:
    """Hides llvmlite's library wrappers from vLLM's kernel scan for the ``with`` block."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "__dict__", {}).get("lib") if ffi is not None else None
    if lib is None:
        yield
        return
    kind = type(lib)
    hidden: list[tuple[dict[str, object], str, object]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if type(value) is kind:
                hidden.append((namespace, name, value))
                del namespace[name]
    try:
        yield
    finally:
        for namespace, name, value in hidden:
            namespace[name] = value
