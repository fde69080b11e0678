"""Inductor's kernels as programmatic dependents (compile/inductor_pdl.py): which
generated kernels are named for the shim's programmatic launch, what the
build changes in Inductor while it generates code and puts back after, and
how a build takes the feature and gives it up. What runs on a GPU is in
tests/gpu/test_matvec_cuda.py."""

from __future__ import annotations

import textwrap
import threading

import pytest
import torch

from cuda_runner.compile import aot, inductor_pdl

POINTWISE = textwrap.dedent("""
    @triton_heuristics.pointwise(size_hints={'x': 512}, triton_meta={'signature': {'in_ptr0': '*bf16', 'out_ptr0': '*bf16'}})
    @triton.jit
    def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
        xoffset = tl.program_id(0) * XBLOCK
        xindex = xoffset + tl.arange(0, XBLOCK)[:]
        tl.extra.cuda.gdc_wait()
        tmp0 = tl.load(in_ptr0 + (xindex), xmask).to(tl.float32)
        tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr0 + (xindex), tmp0, xmask)

    def get_args():
        in_ptr0 = rand_strided((512, ), (1, ), device='cuda:0')
""")


def combo(second_waits: bool) -> str:
    wait = "        tl.extra.cuda.gdc_wait()\n" if second_waits else ""
    return (
        "@triton.jit\n"
        "def triton_poi_fused_1(in_ptr0, in_ptr1, out_ptr0, out_ptr1,\n"
        "                       XBLOCK : tl.constexpr):\n"
        "    pid = tl.program_id(0)\n"
        "    if pid < num_xblocks_0:\n"
        "        tl.extra.cuda.gdc_wait()\n"
        "        tmp0 = tl.load(in_ptr0 + (x0), xmask)  # the key's RoPE\n"
        "        tl.store(out_ptr0 + (x0), tmp0, xmask)\n"
        "    elif pid < num_xblocks_1:\n"
        f"{wait}"
        "        tmp1 = tl.load(in_ptr1 + (x1), xmask)\n"
        "        tl.store(out_ptr1 + (x1), tmp1, xmask)\n"
    )


@pytest.mark.parametrize("source, waits", [
    (POINTWISE, True),
    # a load before the wait: it may read what the launch before is still writing
    (POINTWISE.replace("    tl.extra.cuda.gdc_wait()\n", "").replace("tl.extra.cuda.gdc_launch_dependents()",
                                                                          "tl.extra.cuda.gdc_wait()"), False),
    (combo(second_waits=True), True),
    # a program of the second sub-kernel never passes the first one's wait
    (combo(second_waits=False), False),
    ("@triton.jit\ndef triton_tem_fused_mm_0(arg_A, arg_B, out_ptr0):\n    tl.store(out_ptr0, tl.load(arg_A))\n", False),  # no wait at all
    ("no kernel here", False),
    # combo kernels that deal their programs round-robin: each branch needs its own wait
    (combo(second_waits=False).replace("if pid < num_xblocks_0:", "if pid % 2 == 0:").replace("elif pid < num_xblocks_1:",
                                                                                         "elif pid % 2 == 1:"), False),
    (combo(second_waits=True).replace("elif pid < num_xblocks_1:", "else:"), True),
    # a wait inside a loop's body is no wait for the code after the loop (the loop may not run)
    ("def k(in_ptr0, ws_ptr):\n    for r in range(n):\n        tl.extra.cuda.gdc_wait()\n        a = tl.load(in_ptr0 + r)\n"
     "    tl.store(ws_ptr, a)\n", False),
    # a pointer after a # inside a string is still code
    ("def k(in_ptr0):\n    x = tl.where(c, '#', 0) + tl.load(in_ptr0)\n    tl.extra.cuda.gdc_wait()\n", False),
    # a wait written in a comment is no wait
    ("def k(in_ptr0):\n    # tl.extra.cuda.gdc_wait()\n    tmp0 = tl.load(in_ptr0)\n", False),
    # the seed a random op reads is memory too
    ("def k(seed0, out_ptr0):\n    s = tl.load(seed0)\n    tl.extra.cuda.gdc_wait()\n    tl.store(out_ptr0, s)\n", False),
])
def test_a_kernel_is_taken_only_where_every_pointer_use_comes_after_a_wait(source, waits):
    assert inductor_pdl.waits_before_every_access(source) is waits


def test_only_kernels_that_wait_everywhere_are_named_and_both_kinds_are_counted():
    names = inductor_pdl.ProgrammaticNames()
    assert names.name("fused_add_0", POINTWISE) == "cudarunner_pdl_fused_add_0"
    assert names.name("fused_1", combo(second_waits=False)) == "fused_1"  # waits somewhere, not everywhere: launched plainly
    assert names.name("fused_mm_2", "def triton_tem_fused_mm_2(arg_A):\n    tl.load(arg_A)\n") == "fused_mm_2"  # no PDL code
    assert (names.named, names.plain) == (1, 1)
    # a fused name that starts with the mark itself is put off it unless the kernel waits
    assert names.name("cudarunner_pdl_op_3", "def k(in_ptr0):\n    tl.load(in_ptr0)\n") == "xcudarunner_pdl_op_3"


def test_this_torch_has_every_part_and_one_without_the_pdl_code_generator_goes_without(monkeypatch):
    from torch._inductor.codegen.triton import TritonKernel

    assert inductor_pdl.available(torch)
    monkeypatch.delattr(TritonKernel, "_handle_pdl_before_access")
    assert not inductor_pdl.available(torch)


def test_while_a_build_generates_code_no_node_before_is_seen_and_kernels_are_named_then_all_is_put_back():
    from torch._inductor.codegen import triton as triton_codegen
    from torch._inductor.scheduler import Scheduler

    scheduler = object.__new__(Scheduler)  # the attribute, without building a graph's scheduler
    define_kernel, fused_name = triton_codegen.TritonScheduling.define_kernel, triton_codegen.get_fused_kernel_name
    seen: list[str] = []

    def naming(self, src_code, node_schedule, kernel):  # stands in for Inductor's: names the kernel as it does
        seen.append(triton_codegen.get_fused_kernel_name(node_schedule, "original_aten"))
        return "kernel"

    triton_codegen.TritonScheduling.define_kernel = naming
    try:
        with pytest.raises(RuntimeError, match="the build failed"), inductor_pdl.programmatic_kernels(torch) as names:
            scheduler.previous_node = "the kernel before"
            assert scheduler.previous_node is None  # every load and store of the next kernel then waits
            scheduling = object.__new__(triton_codegen.TritonScheduling)
            scheduling.define_kernel(POINTWISE, [], None)
            scheduling.define_kernel(combo(second_waits=False), [], None)
            other = threading.Thread(target=scheduling.define_kernel, args=(POINTWISE, [], None))
            other.start()
            other.join()  # another thread's build, meanwhile: named as usual
            assert triton_codegen.get_fused_kernel_name([], "original_aten") == "fused"  # outside a kernel's naming: as it was
            raise RuntimeError("the build failed")
        assert triton_codegen.TritonScheduling.define_kernel is naming
    finally:
        triton_codegen.TritonScheduling.define_kernel = define_kernel
    assert seen == ["cudarunner_pdl_fused", "fused", "fused"] and (names.named, names.plain) == (1, 1)
    assert triton_codegen.get_fused_kernel_name is fused_name
    scheduler.previous_node = "the kernel before"
    assert scheduler.previous_node == "the kernel before"
    assert "previous_node" not in Scheduler.__dict__


def test_a_scheduler_made_while_the_class_was_patched_keeps_its_record_after():
    from torch._inductor.scheduler import Scheduler

    with inductor_pdl.programmatic_kernels(torch):
        made_meanwhile = object.__new__(Scheduler)
        made_meanwhile.previous_node = None  # as Scheduler.__init__ sets it
    assert made_meanwhile.previous_node is None  # an AttributeError had Inductor's own assert fail


def test_a_build_inside_another_on_one_thread_neither_hangs_nor_leaves_inductor_patched():
    from torch._inductor.codegen import triton as triton_codegen

    original = triton_codegen.get_fused_kernel_name
    with inductor_pdl.programmatic_kernels(torch), inductor_pdl.programmatic_kernels(torch):
        assert triton_codegen.get_fused_kernel_name is not original
    assert triton_codegen.get_fused_kernel_name is original


def test_a_build_takes_them_only_where_asked_and_where_it_may():
    asked = {inductor_pdl.OWN_OPTION: True}
    assert aot.own_kernels_for({}, True, True, {}).pdl is False  # off by default: the gain is not established
    assert aot.own_kernels_for(asked, True, True, {}).pdl is True
    assert aot.own_kernels_for(asked, True, True, {inductor_pdl.OPTION: False}).pdl is False
    assert aot.own_kernels_for(asked, False, True, {}).pdl is False  # CPU, libtorch or no Triton
    kernels = aot.OwnKernels(attention=False, matvec=False, pdl=True)
    in_use: list[str] = []
    kernels.apply(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), in_use)
    assert in_use == ["pdl"] and kernels.in_graph() == ["pdl"]
    assert aot._with_kernel_options({}, in_use) == {inductor_pdl.OPTION: True}
    kernels.programmatic = 3
    assert kernels.record() == {"programmatic_inductor_kernels": 3}


def test_the_option_takes_true_or_false():
    from cuda_runner.errors import InputError

    assert aot.check_options(torch, {inductor_pdl.OWN_OPTION: True}) == {inductor_pdl.OWN_OPTION: True}
    with pytest.raises(InputError, match="takes true or false"):
        aot.check_options(torch, {inductor_pdl.OWN_OPTION: "yes"})
    # Inductor would put this before every kernel's name, and the shim look there for its mark
    with pytest.raises(InputError, match="holds 'cudarunner_pdl_'"):
        aot.check_options(torch, {"aot_inductor.model_name_for_generated_files": "cudarunner_pdl_model"})


def test_they_are_given_up_first_when_a_build_fails_and_the_user_hears_of_it():
    kernels = aot.OwnKernels(attention=True, matvec=True, pdl=True)
    lines = kernels.blame(["attention", "matvec", "combo", "pdl"], "CompilationError: at 3:4")
    assert kernels.pdl is False and kernels.combo is True and kernels.matvec is True
    assert lines == ["Inductor's kernels as programmatic dependents did not compile (CompilationError: at 3:4); compiling without them"]
    assert kernels.record() == {"programmatic_inductor_kernels_failed": "CompilationError: at 3:4"}
    assert f"{inductor_pdl.OWN_OPTION}=false" in aot.gpu_fault_message("an illegal address", ["attention", "pdl"])


def test_through_the_cli_a_value_other_than_true_or_false_is_refused_in_one_line(tmp_path):
    """The CLI's successful compile with the option is tests/cli/test_provider_cli.py's CPU build."""
    from helpers import run_cli

    program = torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(3, 4),))
    torch.export.save(program, tmp_path / "linear.pt2")
    refused = run_cli("compile", str(tmp_path / "linear.pt2"), "-o", str(tmp_path / "other.bundle"), "--option", f"{inductor_pdl.OWN_OPTION}=maybe")
    assert refused.returncode == 2 and "takes true or false" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "other.bundle").exists()
