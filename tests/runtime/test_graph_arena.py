"""The shim's graph arena (aoti_shim.cpp, `Arena`) without a GPU: the shim runs
over a stand-in libcuda.so.1 (built here, loaded first in a child process)
that hands out addresses and records the driver calls, so what the arena asks
of the driver and which addresses it gives each request can be checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cuda_runner.runtime.providers import own_shim_path

pytestmark = [
    pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the stand-in driver"),
]

# Just what the shim binds at load and the arena calls; addresses only, nothing is ever read or written there.
STAND_IN_DRIVER = r"""
#include <stdio.h>
#include <string.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static CUdeviceptr next_address = 0x100000000000ULL;
static void *current = 0;
static char log_text[1 << 16];
static void note(const char *line) { strncat(log_text, line, sizeof(log_text) - strlen(log_text) - 2); strcat(log_text, "\n"); }
const char *stand_in_log(void) { return log_text; }
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int *device, int index) { *device = index; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **context, int device) { *context = (void *)0x1; return 0; }
CUresult cuCtxGetCurrent(void **context) { *context = current; return 0; }
CUresult cuCtxSetCurrent(void *context) { current = context; return 0; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return 0; }
CUresult cuMemAllocAsync(CUdeviceptr *pointer, size_t bytes, void *stream) {
  char line[96];
  if (bytes > (1ULL << 40)) return 2;  /* CUDA_ERROR_OUT_OF_MEMORY */
  *pointer = next_address;
  next_address += (bytes + 0xFFFFF) & ~0xFFFFFULL;
  snprintf(line, sizeof line, "alloc %zu on %s", bytes, stream == (void *)0x5 ? "arena" : stream ? "other" : "legacy");
  note(line);
  return 0;
}
CUresult cuMemFreeAsync(CUdeviceptr pointer, void *stream) { note(stream == (void *)0x5 ? "free on arena" : "free"); return 0; }
CUresult cuStreamCreate(void **stream, unsigned flags) { *stream = (void *)0x5; note(flags == 1 ? "stream create non-blocking" : "stream create"); return 0; }
CUresult cuStreamDestroy_v2(void *stream) { note("stream destroy"); return 0; }
CUresult cuStreamSynchronize(void *stream) { note(stream == (void *)0x5 ? "synchronize arena" : "synchronize"); return 0; }
CUresult cuCtxSynchronize(void) { note("context synchronize"); return 0; }
CUresult cuMemcpyAsync(CUdeviceptr a, CUdeviceptr b, size_t n, void *s) { return 0; }
CUresult cuMemsetD8Async(CUdeviceptr a, unsigned char v, size_t n, void *s) { return 0; }
CUresult cuDeviceGetDefaultMemPool(void **pool, int device) { return 1; }
CUresult cuMemPoolSetAttribute(void *pool, int attribute, void *value) { return 0; }
CUresult cuGetErrorString(CUresult result, const char **text) { *text = "stand-in error"; return 0; }
CUresult cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h, void *s, void **x,
                        void **y) { return 0; }
"""

CHILD = r"""
import ctypes, json, sys
driver = ctypes.CDLL("libcuda.so.1")
driver.stand_in_log.restype = ctypes.c_char_p
shim = ctypes.CDLL(sys.argv[1])
shim.cudarunner_shim_arena_new.restype = ctypes.c_void_p
shim.cudarunner_shim_arena_new.argtypes = (ctypes.c_int32,)
for name in ("serve", "stop", "release", "bytes"):
    getattr(shim, f"cudarunner_shim_arena_{name}").argtypes = (ctypes.c_void_p,)
shim.cudarunner_shim_arena_bytes.restype = ctypes.c_int64
shim.cudarunner_shim_last_error.restype = ctypes.c_char_p
for name in ("live_tensors", "live_storages"):
    getattr(shim, f"cudarunner_shim_{name}").restype = ctypes.c_int64
seen = {}

def log():
    return driver.stand_in_log().decode().splitlines()

def empty(count, device_type=1, dtype=0):  # uint8 unless told
    sizes, strides, handle = (ctypes.c_int64 * 1)(count), (ctypes.c_int64 * 1)(1), ctypes.c_void_p()
    if shim.cudarunner_empty_strided(1, sizes, strides, dtype, device_type, 0, ctypes.byref(handle)):
        return None, shim.cudarunner_shim_last_error().decode()
    data = ctypes.c_void_p()
    shim.cudarunner_get_data_ptr(handle, ctypes.byref(data))
    return handle, data.value or 0

def free(tensor):
    shim.cudarunner_delete_tensor_object(tensor[0])

arena = shim.cudarunner_shim_arena_new(0)
base = empty(1000)  # not served: the stream-ordered allocator, on the caller's (legacy) stream
seen["before serving"] = log()[-1]
free(base)
shim.cudarunner_shim_arena_serve(arena)
a, b = empty(1000), empty(3000)
seen["first two"] = [a[1], b[1]]
seen["chunk"] = [line for line in log() if "arena" in line or "stream" in line]
seen["reserved"] = shim.cudarunner_shim_arena_bytes(arena)
free(a)
again = empty(800)
seen["reused"] = again[1] == a[1]
free(again)
free(b)  # merged with the idle blocks on both sides: the whole chunk is one idle block again
whole = empty(8 << 20)
seen["merged into the chunk"] = whole[1] == a[1]
extra = empty(1 << 20)  # the chunk is taken: a new one
seen["second chunk"] = extra[1] != a[1] and shim.cudarunner_shim_arena_bytes(arena) == 2 * (8 << 20)
huge = empty(2**63 - 100, dtype=5)  # float16: 2**64 - 200 bytes, which rounded up to a block would wrap to 0
seen["huge"] = huge[1]
host = empty(100, device_type=0)
seen["host memory untouched"] = not (a[1] <= host[1] < a[1] + (16 << 20))
free(host)
seen["stop"] = shim.cudarunner_shim_arena_stop(arena)
seen["after stop"] = log()[-1]
outside = empty(64)
seen["outside"] = log()[-1]
free(outside)
free(whole)
before = len(log())
shim.cudarunner_shim_arena_release(arena)
seen["owner released, a block alive"] = log()[before:]
free(extra)
seen["last block freed"] = log()[before:]
seen["no synchronization"] = not any("context synchronize" in line for line in log())
seen["live"] = [shim.cudarunner_shim_live_tensors(), shim.cudarunner_shim_live_storages()]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def arena_run(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("stand-in-driver")
    (folder / "driver.c").write_text(STAND_IN_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(folder / "libcuda.so.1"), str(folder / "driver.c")], check=True)
    environment = dict(os.environ, LD_LIBRARY_PATH=f"{folder}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    result = subprocess.run([sys.executable, "-c", CHILD, str(own_shim_path())], env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_only_a_served_threads_device_allocations_come_from_the_arena(arena_run):
    assert arena_run["before serving"] == "alloc 1000 on legacy"
    assert arena_run["outside"] == "alloc 64 on legacy"
    assert arena_run["host memory untouched"]


def test_its_chunks_come_from_its_own_stream_and_blocks_are_aligned_and_packed(arena_run):
    """One 8 MiB chunk holds both requests, 256-byte aligned, one after the other."""
    assert arena_run["chunk"] == ["stream create non-blocking", f"alloc {8 << 20} on arena"]
    first, second = arena_run["first two"]
    assert second - first == 1024 and first % 256 == 0
    assert arena_run["reserved"] == 8 << 20


def test_a_freed_block_serves_a_later_request_and_idle_neighbours_merge(arena_run):
    assert arena_run["reused"]
    assert arena_run["merged into the chunk"]
    assert arena_run["second chunk"]


def test_a_request_too_large_fails_with_a_message_instead_of_wrapping(arena_run):
    assert arena_run["huge"].startswith("cannot allocate")


def test_stopping_readies_the_chunks_and_releasing_waits_for_the_last_block(arena_run):
    """No context-wide synchronisation anywhere (it would end another thread's capture);
    the chunks go back on the arena's stream once the owner and every block let go."""
    assert arena_run["stop"] == 0 and arena_run["after stop"] == "synchronize arena"
    assert arena_run["owner released, a block alive"] == []
    assert arena_run["last block freed"] == ["free on arena", "free on arena", "stream destroy"]
    assert arena_run["no synchronization"]
    assert arena_run["live"] == [0, 0]
