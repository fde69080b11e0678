"""compile/inductor_fixes.py: AOTInductor's C++ wrapper declares a size/stride
array in every buffer that uses it, even where a freed buffer's id() comes back."""

from __future__ import annotations

from itertools import count

import pytest

from cuda_runner.compile import inductor_fixes
from cuda_runner.compile.inductor_fixes import declared_per_writer, int_arrays_declared_per_writer

cpp_wrapper_cpu = pytest.importorskip("torch._inductor.codegen.cpp_wrapper_cpu")
if not hasattr(cpp_wrapper_cpu.CppWrapperCpu, "_codegen_int_array_var_impl"):
    pytest.skip("this torch caches the arrays another way", allow_module_level=True)


def _bare_wrapper():
    """A CppWrapperCpu with only what declaring an array reads."""
    from torch._inductor.utils import IndentedBuffer  # noqa: F401  (the writers below)
    from torch.utils._ordered_set import OrderedSet

    wrapper = cpp_wrapper_cpu.CppWrapperCpu.__new__(cpp_wrapper_cpu.CppWrapperCpu)
    wrapper.int_array_id = count()
    wrapper.declared_int_array_vars = OrderedSet()
    return wrapper


def test_a_writer_made_after_another_was_freed_gets_its_own_declaration():
    """Freeing a buffer and making the next is how Inductor's own cache went wrong (CPython hands the freed id() on)."""
    from torch._inductor.utils import IndentedBuffer

    wrapper, first = _bare_wrapper(), IndentedBuffer()
    declared_per_writer(wrapper, "{1L, 64L}", first.writeline, known_statically=True)
    del first
    second = IndentedBuffer()
    name = declared_per_writer(wrapper, "{1L, 64L}", second.writeline, known_statically=True)
    assert f"{name}[] = {{1L, 64L}};" in second.getvalue()


def test_writers_whose_ids_collide_each_get_the_declaration(monkeypatch):
    from torch._inductor.utils import IndentedBuffer

    wrapper = _bare_wrapper()
    monkeypatch.setattr(inductor_fixes, "id", lambda _: 7, raising=False)  # every writer collides, as a reused id() does
    first, second = IndentedBuffer(), IndentedBuffer()
    name = declared_per_writer(wrapper, "{1L, 1L, 64L}", first.writeline, known_statically=True)
    again = declared_per_writer(wrapper, "{1L, 1L, 64L}", second.writeline, known_statically=True)
    assert f"{name}[] = {{1L, 1L, 64L}};" in first.getvalue()
    assert f"{again}[] = {{1L, 1L, 64L}};" in second.getvalue()


def test_the_same_writer_is_given_the_name_it_declared():
    from torch._inductor.utils import IndentedBuffer

    wrapper, writer = _bare_wrapper(), IndentedBuffer()
    names = {declared_per_writer(wrapper, "{64L, 16L, 1L}", writer.writeline, known_statically=True) for _ in range(3)}
    assert len(names) == 1 and writer.getvalue().count("{64L, 16L, 1L}") == 1


def test_each_array_static_or_not_and_each_graph_gets_a_declaration_of_its_own():
    from torch._inductor.utils import IndentedBuffer

    wrapper, writer = _bare_wrapper(), IndentedBuffer()
    first_graph, second_graph = object(), object()
    calls = [("{1L, 64L}", True, None), ("{64L, 1L}", True, None), ("{1L, 64L}", False, None),
             ("{1L, 64L}", True, first_graph), ("{1L, 64L}", True, second_graph)]
    names = [declared_per_writer(wrapper, array, writer.writeline, known_statically=static, graph=graph) for array, static, graph in calls]
    assert len(set(names)) == len(calls)
    lines = writer.getvalue().splitlines()
    for name, (array, static, _) in zip(names, calls):
        declaration = f"{'static constexpr' if static else 'const'} int64_t {name}[] = {array};"
        assert [line for line in lines if f" {name}[]" in line] == [declaration]


def test_an_empty_array_is_a_null_pointer_as_inductor_writes_it():
    from torch._inductor.utils import IndentedBuffer

    wrapper, writer = _bare_wrapper(), IndentedBuffer()
    name = declared_per_writer(wrapper, "{}", writer.writeline, known_statically=False)
    assert writer.getvalue().strip() == f"const int64_t *{name}=nullptr;"


def test_the_mend_lasts_for_the_compile_only():
    original = cpp_wrapper_cpu.CppWrapperCpu.__dict__["codegen_int_array_var"]
    with int_arrays_declared_per_writer():
        assert cpp_wrapper_cpu.CppWrapperCpu.codegen_int_array_var is declared_per_writer
    assert cpp_wrapper_cpu.CppWrapperCpu.__dict__["codegen_int_array_var"] is original
    with pytest.raises(RuntimeError), int_arrays_declared_per_writer():
        raise RuntimeError("a failed compile")
    assert cpp_wrapper_cpu.CppWrapperCpu.__dict__["codegen_int_array_var"] is original


def test_compiles_in_two_threads_keep_the_mend_until_the_last_ends():
    import threading

    original = cpp_wrapper_cpu.CppWrapperCpu.__dict__["codegen_int_array_var"]
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with int_arrays_declared_per_writer():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with int_arrays_declared_per_writer():
            second_in.set()
            first_out.wait(10)
            seen["after the first ended"] = cpp_wrapper_cpu.CppWrapperCpu.codegen_int_array_var

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen["after the first ended"] is declared_per_writer
    assert cpp_wrapper_cpu.CppWrapperCpu.__dict__["codegen_int_array_var"] is original


def test_a_torch_that_defines_the_method_elsewhere_is_left_alone(monkeypatch):
    monkeypatch.delattr(cpp_wrapper_cpu.CppWrapperCpu, "codegen_int_array_var")
    with int_arrays_declared_per_writer():
        assert "codegen_int_array_var" not in cpp_wrapper_cpu.CppWrapperCpu.__dict__
