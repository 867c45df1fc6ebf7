"""The GPU profiling tools' kernels, and the build variants they time, compile for sm_90.

They run only on a GPU (tools/handoff_latency.py, tools/decode_stack_profile.py); here each
variant must compile and export its kernels, so a tool's figures stay reproducible.
"""

import dataclasses

import pytest

from metrale_cli.kernels import compile as kc
from metrale_cli.kernels.registry import MODULES, KernelModule


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("proto", [0, 1, 2])
def test_handoff_latency_kernels_compile(proto, stream):
    module = KernelModule("handoff_latency", "../tools/handoff_latency.cu",
                          (("HOP_PROTO", str(proto)), ("HOP_STREAM", str(stream))), ("hop", "hop_cluster"))
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == ("hop", "hop_cluster")


@pytest.mark.parametrize("defines", [(("STACK_PIECE_BYTES", "0"),),
                                     (("STACK_PIECE_BYTES", "8192"), ("STACK_PACE_NS", "0")),
                                     (("STACK_TIMING_NO_WEIGHT_WAIT", "1"),),
                                     (("STACK_TIMING_NO_DOT", "1"),)])
def test_the_whole_stack_kernel_variants_compile(defines):
    base = MODULES["decode_stack"]
    module = dataclasses.replace(base, defines=base.defines + defines)
    cubin, log = kc.compile_cubin(module)
    assert cubin is not None, log
    assert kc.function_symbols(cubin) == tuple(sorted(base.functions))
