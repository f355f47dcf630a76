"""Programmatic dependent launch (Hopper and later) for this package's Triton kernels: opt-in,
``SGLANG_DSV4_PDL=1``; ``triton_support.pdl_options`` decides a launch's options.

A decode step is a chain of several hundred small kernels; each waits for its predecessor to
finish before its grid is even launched. Launched with the PDL attribute, a kernel's CTAs may be
scheduled while its predecessor still runs, and ``await_predecessor``, the first thing every
kernel here does, holds them until the predecessor has finished and its writes are visible
(``griddepcontrol.wait``), then lets the kernel after it be launched early in turn. Every read
and write still follows the predecessor's completion, so the arithmetic and the bits are the
kernel's own; only the launch latency between kernels is hidden.
"""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # a triton without the intrinsics: the flag stays off (triton_support.pdl_options)
    AVAILABLE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def await_predecessor(PDL: tl.constexpr):
    """First in a kernel launched with PDL: wait for the kernel before it on the stream (its
    completion and memory), then release the launch of the next. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
