"""The reader refuses every damaged or hostile file with one BundleError, and
reads back exactly what the writer wrote."""

from __future__ import annotations

import dataclasses
import json
import random
import struct

import pytest
from forge import forge, method
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_runner.arrays import itemsize, span_problem
from cuda_runner.errors import BundleError, InputError
from cuda_runner.format import Manifest, open_bundle, write_bundle
from cuda_runner.format.bundle import HEADER
from cuda_runner.format.manifest import DeviceSpec, DimSpec, MethodSpec, TensorSpec, manifest_from_json


def _open(tmp_path, data: bytes):
    path = tmp_path / "b.bundle"
    path.write_bytes(data)
    return open_bundle(path)


def _refused(tmp_path, data: bytes, match: str | None = None) -> str:
    with pytest.raises(BundleError, match=match) as info, _open(tmp_path, data) as reader:
        results = reader.verify_all()
        if all(results.values()):
            return "accepted"
        raise BundleError("digest mismatch")
    return str(info.value)


def test_forged_valid_bundle_reads(tmp_path):
    with _open(tmp_path, forge({"methods": {"m": method()}})) as reader:
        assert reader.verify_all() == {"m_so": True, "m_w": True}
        assert bytes(reader.segment("m_w")) == b"W" * 100


# --------------------------------------------------------------------------
# Hostile headers and layouts


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"major": 2}, "newer major version"),
        ({"major": 0}, "unknown major version"),
        ({"header_size": 65}, "header_size"),
        ({"manifest_offset": 128}, "manifest_offset"),
        ({"manifest_size": 1 << 40}, "manifest_size"),
        ({"manifest_size": 0}, "manifest_size"),
        ({"file_size": 10}, "file_size"),
        ({"alignment": 96}, "alignment"),
        ({"alignment": 32}, "alignment"),
        ({"alignment": 1 << 21}, "alignment"),
        ({"reserved": 7}, "reserved"),
    ],
)
def test_hostile_header_fields_are_refused(tmp_path, header, message):
    _refused(tmp_path, forge({"methods": {"m": method()}}, header=header), match=message)


def test_newer_minor_version_is_read(tmp_path):
    with _open(tmp_path, forge({"methods": {"m": method()}, "a_future_field": 1}, header={"minor": 7})) as reader:
        assert reader.version == "1.7"


def test_bad_magic_and_tiny_files(tmp_path):
    _refused(tmp_path, b"", match="too short")
    _refused(tmp_path, b"\x89CRB", match="too short")
    _refused(tmp_path, b"PK\x03\x04" + bytes(100), match="bad magic")
    _refused(tmp_path, bytes(4096), match="bad magic")


def test_checksum_mismatch(tmp_path):
    _refused(tmp_path, forge({"methods": {"m": method()}}, fix_checksum=False), match="checksum")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        # f is the first aligned offset after the manifest
        (lambda f: [(64, 64), (f + 64, 100)], "overlaps the manifest"),
        (lambda f: [(f, 100), (f + 64, 100)], "overlaps"),
        (lambda f: [(f + 64, 64), (f, 100)], "overlaps|out of order|more padding"),
        (lambda f: [(f + 8, 64), (f + 128, 100)], "not a multiple"),
        (lambda f: [(f, 64), (f + 64, 1 << 50)], "past the end"),
        (lambda f: [(f, 64), (f + 64 * 64, 100)], "more padding"),
        (lambda f: [(1 << 62, 64), (f, 100)], "past the end|out of order|more padding"),
    ],
)
def test_segment_layout_violations(tmp_path, layout, message):
    def entries_for(first):
        return [{"name": n, "offset": o, "size": z, "digest": "xxh3-128-tree16m:" + "0" * 32} for n, (o, z) in zip(("m_so", "m_w"), layout(first))]

    first = 64
    for _ in range(4):  # the offsets' digits change the manifest's length
        manifest_end = 64 + len(json.dumps({"methods": {"m": method()}, "segments": entries_for(first)}).encode())
        first = (manifest_end + 63) // 64 * 64
    _refused(tmp_path, forge({"methods": {"m": method()}}, layout=entries_for(first)), match=message)


def test_padding_must_be_zero(tmp_path):
    data = bytearray(forge({"methods": {"m": method()}}))
    with _open(tmp_path, bytes(data)) as reader:
        first = reader.manifest.segments[0]
    data[first.offset - 1] = 1  # the last padding byte before the first segment
    _refused(tmp_path, bytes(data), match="padding")


def test_trailing_bytes_are_refused(tmp_path):
    data = forge({"methods": {"m": method()}})
    _refused(tmp_path, data + b"\0", match="file_size")
    (tmp_path / "b.bundle").write_bytes(data)


# --------------------------------------------------------------------------
# Hostile manifests (with a correct checksum, to reach the deeper checks)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"methods": {}, "methods": {}}', "duplicate key"),
        (b'{"methods": {"m": {"a": NaN}}}', "NaN"),
        (b'{"methods": \xff}', "UTF-8"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply|not valid JSON"),
        (b'{"methods": {"m": 1', "not valid JSON"),
        (b"[]", "must be an object"),
        (b'{"methods": {}}', "empty"),
    ],
)
def test_malformed_manifest_json(tmp_path, raw, message):
    _refused(tmp_path, forge(raw), match=message)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m["methods"].update({"../evil": m["methods"].pop("m")}), "path separator"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(name="x\x1b[2J"), "control character"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(name="a" * 129), "longer than 128"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="complex64"), "complex64"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(shape=[-1]), "out of range"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(shape=[1] * 33), "more than 32"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(shape=["__import__('os')"]), "not a valid dimension expression"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(shape=[True]), "must be an integer"),
        (lambda m: m["methods"]["m"].update(library_segment="absent"), "does not contain"),
        (lambda m: m["methods"]["m"]["device"].update(type="tpu"), "'cpu' or 'cuda'"),
        (lambda m: m.update(required_features=["encryption"]), "requires feature 'encryption'"),
        (lambda m: m["methods"]["m"].update(outputs=[{"name": "o", "dtype": "float32", "shape": []}] * 2), "duplicate names"),
        (lambda m: m["methods"]["m"].update(sample_inputs_segment="m_w"), "both be present"),
        (lambda m: m.update(metadata={"k": 5}), "must be a string"),
        (lambda m: m["methods"].update({f"m{i}": method() for i in range(70)}), "more than 64 methods"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(bounds={"min": 0, "max": 3}), "only int32 and int64 tensors have bounds"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds={"min": 4, "max": 3}), "is empty"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int32", bounds={"min": 0, "max": 1 << 31}), "outside what int32 holds"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds={"min": 0, "max": True}), "must be an integer"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds=[0, 3]), "must be an object"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds=None), "must be an object"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds={"min": 0, "max": 3, "step": 1}), "exactly 'min' and 'max'"),
        (lambda m: m["methods"]["m"]["outputs"][0].update(dtype="int64", bounds={"min": 0, "max": 3}), "bounds for an output"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int8", bounds={"min": 0, "max": 3}), "only int32 and int64"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(span_bounds={"min": 0, "max": 3}), "only int32 and int64 tensors have bounds"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", span_bounds={"min": 4, "max": 3}), "is empty"),
        (lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", span_bounds={"min": 0}), "exactly 'min' and 'max'"),
        (lambda m: m["methods"]["m"]["outputs"][0].update(dtype="int64", span_bounds={"min": 0, "max": 3}), "bounds for an output"),
    ],
)
def test_hostile_manifest_fields(tmp_path, mutate, message):
    manifest = {"methods": {"m": method()}}
    mutate(manifest)
    _refused(tmp_path, forge(manifest), match=message)


def test_unknown_optional_feature_is_ignored(tmp_path):
    with _open(tmp_path, forge({"methods": {"m": method()}, "optional_features": ["hologram"]})) as reader:
        assert reader.manifest.optional_features == ("hologram",)


def test_a_missing_path_is_a_usage_error_and_a_directory_is_not_a_bundle(tmp_path):
    with pytest.raises(InputError):
        open_bundle(tmp_path / "absent.bundle")
    with pytest.raises(BundleError, match="not a regular file"):
        open_bundle(tmp_path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os
    import threading

    fifo = tmp_path / "f.bundle"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(outcome, lambda: open_bundle(fifo)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert isinstance(outcome[0], BundleError) and "FIFO" in str(outcome[0])


def _capture(outcome: list[BaseException], action) -> None:
    try:
        action()
    except BaseException as error:
        outcome.append(error)


# --------------------------------------------------------------------------
# Mutations of one small valid bundle: every change is caught


@pytest.fixture(scope="module")
def small_bundle() -> bytes:
    return forge({"methods": {"m": method()}, "metadata": {"k": "v"}})


def _detected(tmp_path, data: bytes) -> bool:
    try:
        with _open(tmp_path, data) as reader:
            return not all(reader.verify_all().values())
    except BundleError:
        return True


def test_truncation_at_every_offset_is_refused(tmp_path, small_bundle):
    for length in range(len(small_bundle)):
        assert _detected(tmp_path, small_bundle[:length]), f"truncated to {length} bytes was accepted"


def test_bit_flips_in_header_and_manifest_are_refused(tmp_path, small_bundle):
    manifest_end = 64 + struct.unpack_from("<Q", small_bundle, 24)[0]
    for offset in range(manifest_end):
        for bit in range(8):
            data = bytearray(small_bundle)
            data[offset] ^= 1 << bit
            assert _detected(tmp_path, bytes(data)), f"flip of bit {bit} at byte {offset} was accepted"


def test_bit_flips_in_segments_and_padding_are_refused(tmp_path, small_bundle):
    manifest_end = 64 + struct.unpack_from("<Q", small_bundle, 24)[0]
    rng = random.Random(0)
    offsets = list(range(manifest_end, len(small_bundle)))
    for offset in rng.sample(offsets, min(400, len(offsets))):
        data = bytearray(small_bundle)
        data[offset] ^= 1 << rng.randrange(8)
        assert _detected(tmp_path, bytes(data)), f"flip at byte {offset} was accepted"


def test_random_header_field_rewrites_are_refused(tmp_path, small_bundle):
    rng = random.Random(1)
    fields = list(HEADER.unpack(small_bundle[:64]))
    for _ in range(500):
        index = rng.randrange(1, len(fields))
        changed = list(fields)
        if isinstance(fields[index], bytes):
            changed[index] = bytes(rng.randrange(256) for _ in fields[index])
        else:
            bits = (None, 16, 16, 32, 64, 64, 64, 32, 32)[index]
            changed[index] = rng.choice([0, 1, rng.getrandbits(bits), (1 << bits) - 1, fields[index] + 1])
        if changed == fields:
            continue
        data = HEADER.pack(*changed) + small_bundle[64:]
        assert _detected(tmp_path, data)


def test_zero_and_random_files_are_refused(tmp_path):
    rng = random.Random(2)
    for size in (1, 63, 64, 65, 4096, 100_000):
        assert _detected(tmp_path, bytes(size))
        assert _detected(tmp_path, rng.randbytes(size))


# --------------------------------------------------------------------------
# Property: what is written reads back identical

_names = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/\\\x85"), min_size=1, max_size=20).filter(lambda s: s not in (".", ".."))
_dtypes = st.sampled_from(["float32", "bfloat16", "int64", "bool", "uint8"])
_shapes = st.lists(st.one_of(st.integers(0, 1 << 40), st.just("d")), max_size=4)
_bounds = st.one_of(st.none(), st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1)).map(sorted).map(tuple))
_tensors = st.builds(lambda name, dtype, shape, bounds, span: TensorSpec(name, dtype, tuple(shape), *((bounds, span) if dtype == "int64" else (None, None))),
                     _names, _dtypes, _shapes, _bounds, _bounds).filter(
    lambda spec: span_problem([entry for entry in spec.shape if isinstance(entry, int)], itemsize(spec.dtype)) is None)  # a shape some array can have


@st.composite
def _manifests(draw):
    segments = draw(st.dictionaries(_names, st.binary(max_size=300), min_size=1, max_size=5))
    names = list(segments)
    inputs = tuple({spec.name: spec for spec in draw(st.lists(_tensors, max_size=4))}.values())
    outputs = tuple({spec.name: dataclasses.replace(spec, bounds=None, span_bounds=None) for spec in draw(st.lists(_tensors, max_size=4))}.values())
    method_spec = MethodSpec(
        name="m", device=DeviceSpec("cuda", compute_capability="9.0"), library_segment=names[0],
        weights_segment=draw(st.sampled_from([None, *names])), inputs=inputs, outputs=outputs,
        dims={"d": DimSpec("d", 1, draw(st.one_of(st.none(), st.integers(1, 1000))), 2)}, torch_version="2.11",
    )
    metadata = draw(st.dictionaries(_names, st.text(max_size=50), max_size=4))
    return Manifest(methods={"m": method_spec}, metadata=metadata), segments


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_manifests(), st.sampled_from([64, 4096]))
def test_write_then_read_roundtrips(tmp_path, case, alignment):
    manifest, segments = case
    path = tmp_path / "rt.bundle"
    write_bundle(path, manifest, segments, alignment=alignment)
    with open_bundle(path) as reader:
        assert reader.verify_all() == dict.fromkeys(segments, True)
        for name, data in segments.items():
            assert bytes(reader.segment(name)) == data
            assert reader.manifest.segment(name).offset % alignment == 0
        read = reader.manifest
    assert read.methods == manifest.methods
    assert read.metadata == manifest.metadata
    assert manifest_from_json(json.loads(json.dumps(read.to_json()))) == read


def test_an_invalid_manifest_is_the_writers_callers_error(tmp_path):
    manifest = Manifest(methods={"m": MethodSpec("m", DeviceSpec("cpu"), "missing", None, (), (), {}, "2.13")})
    with pytest.raises(InputError, match="manifest to write is invalid"):
        write_bundle(tmp_path / "out.bundle", manifest, {"other": b"x"})
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_keeps_the_old_bundle_and_leaves_no_temp(tmp_path):
    """The weights come from a path that cannot be read (a folder): the failure
    comes once the temp file is open and the library is being written into it."""
    import os

    from cuda_runner.errors import WriteError

    manifest = Manifest(methods={"m": MethodSpec("m", DeviceSpec("cpu"), "m_so", "m_w", (), (), {}, "2.13")})
    target = tmp_path / "out.bundle"
    write_bundle(target, manifest, {"m_so": b"old library", "m_w": b"old weights"})
    previous = target.read_bytes()
    unreadable = tmp_path / "weights"
    unreadable.mkdir()
    with pytest.raises(WriteError, match="weights: Is a directory"):
        write_bundle(target, manifest, {"m_so": b"new library" * 1000, "m_w": unreadable})
    assert target.read_bytes() == previous
    assert sorted(os.listdir(tmp_path)) == ["out.bundle", "weights"]


# --------------------------------------------------------------------------
# Background checks: one per segment, shared by the methods that load it


def test_a_segment_checked_in_the_background_is_hashed_once_for_every_method(tmp_path, monkeypatch):
    from cuda_runner.format import bundle

    hashed = []
    real_digest = bundle.segment_digest
    monkeypatch.setattr(bundle, "segment_digest", lambda data: hashed.append(len(data)) or real_digest(data))
    with _open(tmp_path, forge({"methods": {"m": method()}})) as reader:
        first = reader.verify_in_background("m_w")
        assert reader.verify_in_background("m_w") is first  # a second method waits on the same check
        first.result()
        assert reader.verify_in_background("m_w") is first and hashed == [100]
        assert reader.verify_all() == {"m_so": True, "m_w": True}  # a re-check asked for hashes again
        reader.verify_in_background("m_w").result()
        assert hashed.count(100) == 3


def test_a_damaged_segment_fails_every_methods_background_check(tmp_path):
    data = bytearray(forge({"methods": {"m": method()}}))
    data[data.rindex(b"W" * 100)] ^= 1
    with _open(tmp_path, bytes(data)) as reader:
        for _ in range(2):
            with pytest.raises(BundleError, match="'m_w' is damaged"):
                reader.verify_in_background("m_w").result()
