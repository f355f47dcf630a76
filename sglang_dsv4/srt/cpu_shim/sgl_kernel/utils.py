"""``sgl_kernel.utils`` as SGLang imports it on the CUDA code path (module-level names only): every
name resolves through the package stand-in, so importing works and calling raises plainly."""

from sgl_kernel import __getattr__  # noqa: F401  (PEP 562: this module's attribute fallback)
