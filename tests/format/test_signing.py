"""Signed bundles: a trusted key's signature is required, checked before any library code loads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import ROOT, cli

import cuda_runner
from cuda_runner.errors import BundleError, InputError
from cuda_runner.format.signing import sign_file, signature_path

ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")


def _key_pair(folder, name):
    key = ec.generate_private_key(ec.SECP256R1())
    private = folder / f"{name}.pem"
    public = folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def signed(dict_mlp_bundle, tmp_path):
    bundle = tmp_path / "model.bundle"
    bundle.write_bytes(dict_mlp_bundle.path.read_bytes())
    private, public = _key_pair(tmp_path, "builder")
    _, stranger = _key_pair(tmp_path, "stranger")
    sign_file(bundle, private, shard_size=4096)  # small shards: every segment spans several
    return bundle, public, stranger


@pytest.fixture
def memfds(monkeypatch):
    """Counts uses of model library code: each load takes a lease on its library
    (a new memfd, or a copy this process loaded before)."""
    import cuda_runner.runtime.method as method_module

    leased = []
    real = method_module.lease_library

    def counting(data, label, **options):
        leased.append(label)
        return real(data, label, **options)

    monkeypatch.setattr(method_module, "lease_library", counting)
    return leased


def test_a_signed_bundle_runs_with_its_key(signed, memfds):
    bundle, public, _ = signed
    result = cli("run", str(bundle), "--random-inputs", "--trusted-key", str(public))
    assert result.returncode == 0, result.stderr
    assert len(memfds) == 1
    from cuda_runner.format.signing import load_public_key

    fingerprint = load_public_key(public).fingerprint
    assert f"signature: verified before loading, by trusted key {fingerprint}" in result.stdout  # the run says what it checked
    document = json.loads(cli("run", str(bundle), "--random-inputs", "--trusted-key", str(public), "--json").stdout)
    assert document["signature"]["signer"] == fingerprint
    assert json.loads(cli("run", str(bundle), "--random-inputs", "--json").stdout)["signature"] is None
    inspected = json.loads(cli("inspect", str(bundle), "--trusted-key", str(public), "--json", "--verify").stdout)
    assert inspected["signature"]["verified"] is True and inspected["runnable_here"] is True


def _refused(args, memfds):
    result = cli(*args)
    assert result.returncode == 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
    assert memfds == []  # no library code was loaded
    return result.stderr


def test_another_key_an_unsigned_bundle_and_a_garbage_signature_are_refused(signed, memfds, tmp_path):
    bundle, public, stranger = signed
    assert "not made by any trusted key" in _refused(["run", str(bundle), "--random-inputs", "--trusted-key", str(stranger)], memfds)
    good = signature_path(bundle).read_bytes()
    for garbage, message in ((good[: len(good) // 2], "not a signature"), (b"\x00" * 100, "not a signature"),
                             (json.dumps({"dsseEnvelope": {}}).encode(), "no valid DSSE envelope")):
        signature_path(bundle).write_bytes(garbage)
        assert message in _refused(["run", str(bundle), "--random-inputs", "--trusted-key", str(public)], memfds)
    signature_path(bundle).unlink()
    assert "not signed" in _refused(["run", str(bundle), "--random-inputs", "--trusted-key", str(public)], memfds)


def test_a_signature_for_another_file_is_refused(signed, embedder_bundle, tmp_path, memfds):
    bundle, public, _ = signed
    private = tmp_path / "builder.pem"
    other = tmp_path / "other.bundle"
    other.write_bytes(embedder_bundle.path.read_bytes())
    sign_file(other, private, shard_size=4096)
    signature_path(bundle).write_bytes(signature_path(other).read_bytes())
    _refused(["run", str(bundle), "--random-inputs", "--trusted-key", str(public)], memfds)


@pytest.mark.parametrize("where", ["header", "manifest", "library", "padding", "sample"])
def test_one_byte_changed_before_the_library_is_refused_without_loading_code(signed, memfds, where):
    bundle, public, _ = signed
    data = bytearray(bundle.read_bytes())
    with cuda_runner.format.open_bundle(bundle) as reader:
        manifest_end = reader.header.manifest_offset + reader.header.manifest_size
        library = reader.manifest.segment("forward_so_blob")
        sample = reader.manifest.segment("forward_sample_inputs")
        first = reader.manifest.segments[0]
    if where == "manifest":
        offset = bytes(data).index(b"dict_mlp", 64, manifest_end) + 7  # the metadata value: still valid JSON
    else:
        offset = {"header": 40, "library": library.offset + library.size // 2, "padding": first.offset - 1, "sample": sample.offset + 10}[where]
    data[offset] ^= 0x01
    # Re-sealed so the bundle is valid in itself: only the signature can tell.
    bundle.write_bytes(_resealed(bytes(data), where))
    if where not in ("header", "padding"):
        assert cli("inspect", str(bundle), "--verify").returncode == 0  # the bundle alone looks fine
        memfds.clear()  # that check ran the library; what follows must not
    _refused(["run", str(bundle), "--self-test", "--trusted-key", str(public)], memfds)


def _resealed(data: bytes, where: str) -> bytes:
    """Recompute the header checksum and segment digests after a change, as an attacker would."""
    from dataclasses import replace

    from cuda_runner.format import bundle as bundle_module
    from cuda_runner.format.digest import segment_digest

    if where in ("header", "padding"):
        return data  # a changed header or padding is refused by the reader or the signature alike
    header = bundle_module.Header(*bundle_module.HEADER.unpack(data[:64])[1:])
    manifest_end = 64 + header.manifest_size
    manifest = bundle_module.parse_manifest_bytes(data[64:manifest_end])
    if where != "manifest":
        segments = tuple(replace(entry, digest=segment_digest(data[entry.offset:entry.offset + entry.size])) for entry in manifest.segments)
        encoded = bundle_module._encode_manifest(replace(manifest, segments=segments))
        if len(encoded) == header.manifest_size:
            data = data[:64] + encoded + data[manifest_end:]
    prefix = bundle_module.HEADER.pack(bundle_module.MAGIC, *[getattr(header, field) for field in
                                      ("major", "minor", "header_size", "manifest_offset", "manifest_size", "file_size", "alignment", "reserved")], bytes(16))
    checksum = bundle_module._checksum(prefix[:48], data[64:manifest_end])
    return prefix[:48] + checksum + data[64:]


def test_changed_weights_are_refused_before_any_run(signed, tmp_path):
    bundle, public, _ = signed
    data = bytearray(bundle.read_bytes())
    with cuda_runner.format.open_bundle(bundle) as reader:
        weights = reader.manifest.segment("forward_weights_blob")
    data[weights.offset + 7] ^= 0x01
    bundle.write_bytes(_resealed(bytes(data), "weights"))
    with pytest.raises(BundleError, match="header and manifest do not match their signature"):  # resealed: the manifest's digest changed
        cuda_runner.load(bundle, trusted_keys=[public])


@pytest.mark.parametrize("shard_size", [16 << 20, None, 4096])  # one shard holding everything, the whole file, small shards
@pytest.mark.parametrize("segment", ["forward_so_blob", "forward_weights_blob", "call_helper_so", "forward_sample_outputs"])
def test_a_changed_segment_is_named_whatever_signed_range_holds_it(signed, tmp_path, shard_size, segment):
    """A segment changed after signing is reported as that segment, its bytes against its digest in the
    manifest, even where one signed range also holds the header and manifest (checked first)."""
    bundle, public, _ = signed
    sign_file(bundle, tmp_path / "builder.pem", shard_size=shard_size)
    data = bytearray(bundle.read_bytes())
    with cuda_runner.format.open_bundle(bundle) as reader:
        entry = reader.manifest.segment(segment)
    data[entry.offset + entry.size // 2] ^= 0x01  # not resealed: the manifest still has the signed digest
    bundle.write_bytes(bytes(data))
    shared = shard_size is None or entry.offset < shard_size  # the range that failed also holds the header and manifest
    commands = [["run", str(bundle), "--self-test"], ["bench", str(bundle), "--iterations", "1"]] + ([["inspect", str(bundle)]] if shared else [])
    for args in commands:
        result = cli(*args, "--trusted-key", str(public))
        assert result.returncode == 3 and len(result.error_lines) == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        message = result.error_lines[0]
        assert f"segment {segment!r} does not match its signature: its bytes differ from its digest in the" in message, message
        assert "header and manifest" not in message
        assert message.endswith("(covered by the same signed bytes); the bundle changed after it was signed") == shared, message


def test_keys_from_the_environment_and_required_signatures(signed, monkeypatch):
    bundle, public, stranger = signed
    monkeypatch.setenv("CUDA_RUNNER_TRUSTED_KEYS", f"{stranger}{os.pathsep}{public}")
    with cuda_runner.load(bundle) as model:
        model.run({"x": np.ones((1, 16), np.float32), "bias": np.zeros(8, np.float32)})
    monkeypatch.delenv("CUDA_RUNNER_TRUSTED_KEYS")
    with pytest.raises(InputError, match="no trusted key"):
        cuda_runner.load(bundle, require_signature=True)
    result = cli("run", str(bundle), "--random-inputs", "--require-signature")
    assert result.returncode == 2 and "no trusted key" in result.stderr


def test_inspect_shows_who_signed(signed):
    bundle, public, stranger = signed
    unchecked = cli("inspect", str(bundle))
    assert unchecked.returncode == 0 and "not checked (no trusted key given" in unchecked.stdout
    wrong = cli("inspect", str(bundle), "--trusted-key", str(stranger))
    assert wrong.returncode == 3 and "NOT verified" in wrong.stdout
    right = cli("inspect", str(bundle), "--trusted-key", str(public))
    assert right.returncode == 0 and "verified, signed by the trusted key" in right.stdout


def test_whole_file_signatures_verify_too(signed, tmp_path):
    bundle, public, _ = signed
    sign_file(bundle, tmp_path / "builder.pem", shard_size=None)
    with cuda_runner.load(bundle, trusted_keys=[public]) as model:
        assert model.method().spec.name == "forward"


def test_a_signature_made_by_the_model_signing_tool_verifies():
    """tests/data/model-signing: a file signed by `model_signing sign key` (model-signing 1.1.1)."""
    from cuda_runner.format.signing import load_public_key, read_signature

    folder = ROOT / "tests" / "data" / "model-signing"
    target = folder / "model.bin"
    signed = read_signature(folder / "model.bin.sig", target.stat().st_size, [load_public_key(folder / "public.pem")])
    signed.check_range(memoryview(target.read_bytes()), 0, target.stat().st_size, "model.bin")
    assert signed.method == "files"
    tampered = bytearray(target.read_bytes())
    tampered[0] ^= 1
    with pytest.raises(BundleError):
        read_signature(folder / "model.bin.sig", len(tampered), [load_public_key(folder / "public.pem")]).check_range(
            memoryview(bytes(tampered)), 0, len(tampered), "model.bin")


@pytest.mark.parametrize("shard_size", [4096, 16 << 20, None])
def test_library_bytes_changed_in_place_after_the_check_are_refused(signed, tmp_path, shard_size):
    """The library is checked on the private copy that gets loaded, not on the mapping checked earlier."""
    from cuda_runner.format import open_bundle
    from cuda_runner.format.signing import load_public_key
    from cuda_runner.runtime.devices import Device
    from cuda_runner.runtime.method import Method

    bundle, public, _ = signed
    sign_file(bundle, tmp_path / "builder.pem", shard_size=shard_size)
    with open_bundle(bundle) as reader:
        reader.require_signature([load_public_key(public)])
        library = reader.manifest.segment("forward_so_blob")
        with open(bundle, "r+b") as handle:  # an in-place change, visible through the mapping
            handle.seek(library.offset + 100)
            original = handle.read(1)
            handle.seek(library.offset + 100)
            handle.write(bytes([original[0] ^ 1]))
        with pytest.raises(BundleError, match="does not match its signature"):
            Method.load(reader, reader.manifest.methods["forward"], Device("cpu"))


def test_a_fifo_or_device_as_signature_is_refused_without_blocking(signed):
    bundle, public, _ = signed
    signature_path(bundle).unlink()
    os.mkfifo(signature_path(bundle))
    result = cli("run", str(bundle), "--random-inputs", "--trusted-key", str(public))
    assert result.returncode == 3 and "not a regular file" in result.stderr
    assert cli("inspect", str(bundle)).returncode == 0  # shown as present, never read
    signature_path(bundle).unlink()
    os.symlink("/dev/zero", signature_path(bundle))
    assert cli("run", str(bundle), "--random-inputs", "--trusted-key", str(public)).returncode == 3


def _held_by_this_process(path) -> tuple[bool, bool]:
    """Whether the file is mapped into this process (/proc/self/maps), and whether a descriptor is open on it."""
    name = str(path.resolve())
    with open("/proc/self/maps") as maps:
        mapped = any(line.rstrip("\n").endswith(" " + name) for line in maps)
    folder = "/proc/self/fd"
    opened = False
    for entry in os.listdir(folder):
        try:
            opened = opened or os.readlink(os.path.join(folder, entry)) == name
        except OSError:  # closed meanwhile
            pass
    return mapped, opened


def test_closing_a_signed_model_unmaps_the_bundle(signed):
    bundle, public, _ = signed
    model = cuda_runner.load(bundle, trusted_keys=[public])
    assert _held_by_this_process(bundle) == (True, True)
    model.close()
    assert _held_by_this_process(bundle) == (False, False)


def test_signed_ranges_must_tile_the_file_within_its_size():
    from pathlib import Path

    from cuda_runner.format.signing import _signed_ranges

    def payload(names):
        resources = [{"name": name, "algorithm": "sha256", "digest": "00" * 32} for name in names]
        return json.dumps({"_type": "https://in-toto.io/Statement/v1", "predicateType": "https://model_signing/signature/v1.0",
                           "predicate": {"resources": resources, "serialization": {"method": "shards", "hash_type": "sha256"}}}).encode()

    assert len(_signed_ranges(payload([".:0:60", ".:60:100"]), 100, "k", Path("s")).ranges) == 2
    for names in ([".:0:150", ".:150:100"], [".:0:50"], [".:0:60", ".:50:100"], [".:0:0", ".:0:100"]):
        with pytest.raises(BundleError):
            _signed_ranges(payload(names), 100, "k", Path("s"))
