"""The Triton interpreter of older releases under a newer NumPy, for the tests' CPU runs of the kernels."""

import inspect


def read_scalars_as_newer_triton() -> None:
    """Triton 3.6's interpreter reads a run-time scalar (a 1-element array) as an index with ``int(array)``, which
    NumPy 2.4 refuses (only 0-d arrays convert): every kernel whose loop bounds are run-time values failed in it
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``). Newer interpreters squeeze the
    array first; this gives an older one the same reading. Nothing changes where Triton is absent or already does."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        current = patch is None or "squeeze" in inspect.getsource(patch)
    except (OSError, TypeError):
        current = True
    if current:
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
