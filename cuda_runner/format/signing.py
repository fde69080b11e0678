"""Detached signatures of bundle files, in the OpenSSF model-signing format.

A signature (`model.bundle.sig`) is a Sigstore bundle (v0.3 JSON) holding a
DSSE envelope whose payload is an in-toto statement with the model-signing
predicate (`https://model_signing/signature/v1.0`): SHA-256 digests of the
file, either whole ("files" method) or in fixed-size shards ("shards"
method), signed with an elliptic-curve key (the model-signing "key" method).
docs/provenance.md says why this format and what we check.

Verifying checks the envelope's signature against trusted public keys first
(cheap), then the file's bytes against the signed digests: a caller asks for
the byte ranges it is about to trust (`SignedFile.check_range`), so that the
library is checked before it is loaded and the weights while they upload.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BundleError, InputError
from ..files import read_small

if TYPE_CHECKING:
    import hashlib


def _new_sha256(data: bytes | memoryview = b"") -> hashlib._Hash:
    """hashlib's SHA-256, imported on first use: hashlib loads OpenSSL, about
    8 ms of start-up that a run of an unsigned bundle need not pay."""
    import hashlib

    return hashlib.sha256(data)


SIGNATURE_SUFFIX = ".sig"
DEFAULT_SHARD_SIZE = 16 << 20
MAX_SIGNATURE_BYTES = 16 << 20
MAX_KEY_BYTES = 64 << 10  # a PEM elliptic-curve key is a few hundred bytes
# The curves model-signing signs with; others (P-224, secp256k1) are refused, not silently used.
SUPPORTED_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
MAX_SHARDS = 1 << 20
TRUSTED_KEYS_VARIABLE = "CUDA_RUNNER_TRUSTED_KEYS"

_BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_PAYLOAD_TYPE = "application/vnd.in-toto+json"
_STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_IGNORED_BY_DEFAULT = [".git", ".gitignore", ".gitattributes", ".github"]  # what model_signing records


def signature_path(bundle: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(bundle) + SIGNATURE_SUFFIX)


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        raise InputError("signatures need the 'cryptography' package: pip install 'cuda-runner[sign]'") from None
    return hashes, serialization, ec


# ---------------------------------------------------------------------------
# Keys


@dataclass(frozen=True)
class TrustedKey:
    path: Path
    key: Any  # an EllipticCurvePublicKey
    fingerprint: str  # SHA-256 of the key's DER SubjectPublicKeyInfo


def _load_key(path: Path, kind: str, read: Any, expected: type) -> Any:
    """A PEM key of the elliptic-curve type model-signing uses, or an InputError naming the file."""
    try:
        key: Any = read(read_small(path, f"a PEM {kind} key", MAX_KEY_BYTES))
    except (ValueError, TypeError) as error:
        raise InputError(f"{path} is not a usable PEM {kind} key: {error}") from None
    curve_name = getattr(getattr(key, "curve", None), "name", None)
    if not isinstance(key, expected) or curve_name not in SUPPORTED_CURVES:
        curve = f" (this one is {curve_name})" if curve_name else ""
        raise InputError(f"{path}: only elliptic-curve keys on P-256, P-384 or P-521 are supported, as by model-signing{curve}")
    return key


def load_public_key(path: str | os.PathLike[str]) -> TrustedKey:
    _, serialization, ec = _crypto()
    key = _load_key(Path(path), "public", serialization.load_pem_public_key, ec.EllipticCurvePublicKey)
    return TrustedKey(Path(path), key, _fingerprint(key))


def _fingerprint(key: Any) -> str:
    _, serialization, _ = _crypto()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return _new_sha256(der).hexdigest()


def trusted_keys(paths: Iterable[str | os.PathLike[str]] = (), *, environment: bool = True) -> list[TrustedKey]:
    """Keys given explicitly, plus those listed in CUDA_RUNNER_TRUSTED_KEYS (os.pathsep-separated)."""
    listed = [Path(path) for path in paths]
    if environment:
        listed += [Path(item) for item in os.environ.get(TRUSTED_KEYS_VARIABLE, "").split(os.pathsep) if item]
    return [load_public_key(path) for path in listed]


def keys_for_loading(paths: Iterable[str | os.PathLike[str]], require: bool) -> list[TrustedKey]:
    """The trusted keys for a load; with `require`, having none is an error."""
    keys = trusted_keys(paths)
    if require and not keys:
        raise InputError(f"a signature is required, but no trusted key is configured (give one, or set {TRUSTED_KEYS_VARIABLE})", subject="trusted_key")
    return keys


# ---------------------------------------------------------------------------
# Digests


def _ranges(size: int, shard_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + shard_size, size)) for start in range(0, size, shard_size)] or [(0, 0)]


_EXTRACT_CHUNK = 8 << 20


def _sha256(view: memoryview) -> bytes:
    return _new_sha256(view).digest()  # hashlib releases the GIL: shards hash in parallel


def _sha256_of(mapping: memoryview, low: int, high: int) -> bytes:
    # Sliced in the worker, so a queued item holds no export of the mapping of its own.
    return _sha256(mapping[low:high])


def _digests(view: memoryview, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    if len(ranges) == 1:
        return [_sha256(view[ranges[0][0]:ranges[0][1]])]
    with ThreadPoolExecutor(max_workers=min(len(ranges), os.cpu_count() or 1), thread_name_prefix="cuda-runner-sha256") as pool:
        return list(pool.map(lambda span: _sha256(view[span[0]:span[1]]), ranges))


def _file_view(path: Path) -> tuple[Any, memoryview]:
    import mmap

    handle = open(path, "rb")  # noqa: SIM115  (closed with the mapping)
    size = os.fstat(handle.fileno()).st_size
    if size == 0:
        handle.close()
        return None, memoryview(b"")
    mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    handle.close()
    return mapping, memoryview(mapping)


# ---------------------------------------------------------------------------
# Signing


def sign_file(path: str | os.PathLike[str], private_key: str | os.PathLike[str], *, shard_size: int | None = DEFAULT_SHARD_SIZE,
              password: bytes | None = None) -> Path:
    """Write `<path>.sig`. shard_size=None signs the whole file as one digest
    (what `model_signing verify key` checks); shards verify faster, in parallel."""
    hashes, serialization, ec = _crypto()
    path = Path(path)
    key = _load_key(Path(private_key), "private", lambda data: serialization.load_pem_private_key(data, password=password), ec.EllipticCurvePrivateKey)
    mapping, view = _file_view(path)
    try:
        ranges = _ranges(len(view), shard_size) if shard_size else [(0, len(view))]
        digests = _digests(view, ranges)
    finally:
        view.release()
        if mapping is not None:
            mapping.close()
    payload = _statement(path.name, ranges, digests, shard_size)
    signature = key.sign(_pae(payload), ec.ECDSA(hashes.SHA256()))
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    document = {
        "mediaType": _BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": _new_sha256(public_pem).hexdigest()}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": _PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    from ..files import write_file

    def write(handle: Any) -> None:
        handle.write(json.dumps(document, indent=2).encode() + b"\n")

    return write_file(signature_path(path), write)


def _statement(name: str, ranges: Sequence[tuple[int, int]], digests: Sequence[bytes], shard_size: int | None) -> bytes:
    serialization: dict[str, Any] = {"method": "shards" if shard_size else "files", "hash_type": "sha256",
                                     "allow_symlinks": False, "ignore_paths": _IGNORED_BY_DEFAULT}
    if shard_size:
        serialization["shard_size"] = shard_size
        resources = [{"algorithm": f"sha256-sharded-{shard_size}", "digest": digest.hex(), "name": f".:{start}:{end}"}
                     for (start, end), digest in zip(ranges, digests)]
    else:
        resources = [{"algorithm": "sha256", "digest": digests[0].hex(), "name": "."}]
    root = _new_sha256(b"".join(digests)).hexdigest()
    statement = {
        "_type": _STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": root}}],
        "predicateType": _PREDICATE_TYPE,
        "predicate": {"resources": resources, "serialization": serialization},
    }
    return json.dumps(statement, indent=2).encode()


def _pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    kind = _PAYLOAD_TYPE.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


# ---------------------------------------------------------------------------
# Verifying


class SignatureMismatch(BundleError):
    """Bytes [start, end) of the file, signed as one range, do not hash to their signed digest.
    The reader holding the file can tell which part of them changed (BundleReader)."""

    def __init__(self, what: str, start: int, end: int):
        super().__init__(f"{what} does not match its signature: the bundle changed after it was signed")
        self.what, self.start, self.end = what, start, end


@dataclass
class SignedFile:
    """A signature whose envelope verified: the signed digests of the file's byte ranges."""

    signer: str  # the fingerprint of the trusted key that verified it
    size: int
    ranges: list[tuple[int, int]]  # sorted, contiguous, covering [0, size)
    digests: list[bytes]
    method: str  # "files" or "shards"

    def __post_init__(self) -> None:
        self._checked: set[int] = set()  # ranges of the *mapping* found intact (data, not code)
        self._pending: dict[int, Future[bytes]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def prefetch(self, mapping: memoryview) -> None:
        """Start hashing every range of the file's mapping on all cores, so that
        later checks of the mapping mostly wait for work already done."""
        if len(self.ranges) < 2:
            return  # one whole-file digest: the library check hashes it all anyway
        self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="cuda-runner-sha256")
        for index, (low, high) in enumerate(self.ranges):
            if index not in self._checked:
                self._pending[index] = self._pool.submit(_sha256_of, mapping, low, high)

    def cancel(self) -> None:
        """Stop hashing and wait for the threads still reading (before the mapping closes)."""
        pool, self._pool = self._pool, None
        self._pending = {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # queued items (holding the mapping) are dropped

    def _covering(self, start: int, end: int) -> list[int]:
        return [index for index, (low, high) in enumerate(self.ranges) if low < end and high > start]

    def check_range(self, view: memoryview, start: int, end: int, what: str, base: int = 0, *, mapped: bool = False) -> None:
        """Hash every signed range overlapping [start, end) of the file.

        `view` holds the file's bytes from offset `base`. A private copy (the
        library, about to be loaded) is always hashed in full: what was found
        intact in the mapping earlier says nothing about this copy. With
        `mapped`, `view` is the mapping `prefetch` was given, and ranges found
        intact there before, or being hashed there now, are not hashed again."""
        indexes = self._covering(start, end)
        if mapped:
            indexes = [index for index in indexes if index not in self._checked]
            try:
                pending = {index: self._pending[index] for index in indexes if index in self._pending}
                fresh = [index for index in indexes if index not in pending]
                computed = dict(zip(fresh, _digests(view, [self.ranges[index] for index in fresh]) if fresh else []))
                actual = [computed[index] if index in computed else pending[index].result() for index in indexes]
            except CancelledError:
                raise BundleError("the bundle was closed while its signature was being checked") from None
        else:
            spans = [(self.ranges[index][0] - base, self.ranges[index][1] - base) for index in indexes]
            actual = _digests(view, spans) if spans else []
        for index, digest in zip(indexes, actual):
            if digest != self.digests[index]:
                raise SignatureMismatch(what, *self.ranges[index])
            if mapped:
                self._checked.add(index)

    def extract_checked(self, mapping: memoryview, start: int, end: int, what: str) -> bytes:
        """The bytes [start, end) of the file, taken from the very copies that were
        hashed: the covering ranges are copied chunk by chunk from the mapping,
        each chunk hashed as it is copied, so a change to the file meanwhile
        cannot slip in between the check and the use (whole-file signatures
        included, where the covering range is the whole file)."""
        kept = bytearray()
        for index in self._covering(start, end):
            low, high = self.ranges[index]
            hasher = _new_sha256()
            for chunk_start in range(low, high, _EXTRACT_CHUNK):
                chunk_end = min(chunk_start + _EXTRACT_CHUNK, high)
                keep_from, keep_to = max(start, chunk_start), min(end, chunk_end)
                if keep_from >= keep_to:  # nothing kept from here: hash the mapping, no copy needed
                    hasher.update(mapping[chunk_start:chunk_end])
                    continue
                chunk = bytes(mapping[chunk_start:chunk_end])
                hasher.update(chunk)
                kept += chunk[keep_from - chunk_start:keep_to - chunk_start]
            if hasher.digest() != self.digests[index]:
                raise SignatureMismatch(what, low, high)
            self._checked.add(index)  # the mapping held these bytes just now
        return bytes(kept)

    def to_json(self) -> dict[str, Any]:
        return {"signer": self.signer, "method": self.method, "shards": len(self.ranges)}


def read_signature_file(path: Path) -> bytes:
    """The bytes of a signature file: a regular file of at most MAX_SIGNATURE_BYTES,
    opened without blocking (a FIFO or a device is refused, never read)."""
    return read_small(path, "a signature", MAX_SIGNATURE_BYTES, not_regular=BundleError)


def read_signature(path: Path, file_size: int, keys: Sequence[TrustedKey]) -> SignedFile:
    """Parse `path` and check its envelope against `keys`; BundleError on anything else."""
    if not os.path.lexists(path):
        raise BundleError(f"the bundle is not signed: {path} does not exist")
    try:
        document = json.loads(read_signature_file(path))
    except InputError as error:  # there, but unreadable: the signature policy cannot pass
        raise BundleError(f"the signature cannot be read: {error}") from None
    except (ValueError, RecursionError):
        raise BundleError(f"{path} is not a signature (not JSON)") from None
    payload, signatures = _envelope(document, path)
    signer = _verify_envelope(payload, signatures, keys, path)
    return _signed_ranges(payload, file_size, signer, path)


def _envelope(document: Any, path: Path) -> tuple[bytes, list[bytes]]:
    try:
        envelope = document["dsseEnvelope"]
        if envelope["payloadType"] != _PAYLOAD_TYPE:
            raise BundleError(f"{path}: unexpected payload type {str(envelope['payloadType'])[:60]!r}")
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [base64.b64decode(entry["sig"], validate=True) for entry in envelope["signatures"][:16]]
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError):
        raise BundleError(f"{path} is not a model-signing signature (no valid DSSE envelope)") from None
    if not signatures:
        raise BundleError(f"{path} holds no signature")
    return payload, signatures


def _verify_envelope(payload: bytes, signatures: list[bytes], keys: Sequence[TrustedKey], path: Path) -> str:
    hashes, _, ec = _crypto()
    from cryptography.exceptions import InvalidSignature

    message = _pae(payload)
    for key in keys:
        for signature in signatures:
            try:
                key.key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
            except (InvalidSignature, ValueError):
                continue
            return key.fingerprint
    raise BundleError(f"{path} was not made by any trusted key ({len(keys)} given)")


def _signed_ranges(payload: bytes, file_size: int, signer: str, path: Path) -> SignedFile:
    """The ranges and digests of a verified payload, checked for consistency."""
    try:
        statement = json.loads(payload)
        if statement["_type"] != _STATEMENT_TYPE or statement["predicateType"] != _PREDICATE_TYPE:
            raise ValueError("not a model-signing statement")
        predicate = statement["predicate"]
        method = predicate["serialization"]["method"]
        hash_type = predicate["serialization"]["hash_type"]
        resources = predicate["resources"]
        if hash_type != "sha256" or method not in ("files", "shards") or not isinstance(resources, list) or len(resources) > MAX_SHARDS:
            raise ValueError(f"unsupported serialization {method}/{hash_type}")
        spans = [_span(resource["name"], method, file_size) for resource in resources]
        digests = [bytes.fromhex(resource["digest"]) for resource in resources]
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise BundleError(f"{path}: the signed statement cannot be used: {error}") from None
    order = sorted(range(len(spans)), key=lambda index: spans[index])
    ranges, digests = [spans[index] for index in order], [digests[index] for index in order]
    expected_start = 0
    for start, end in ranges:
        if start != expected_start or not start < end <= file_size:
            raise BundleError(f"{path}: the signature covers another file (its ranges do not tile {file_size} bytes)")
        expected_start = end
    if expected_start != file_size:
        raise BundleError(f"{path} is the signature of a file of {expected_start} bytes; this bundle has {file_size}")
    return SignedFile(signer, file_size, ranges, digests, method)


def _span(name: Any, method: str, file_size: int) -> tuple[int, int]:
    if method == "files":
        if name != ".":
            raise ValueError(f"a signature of several files ({str(name)[:40]!r}); a bundle is one file")
        return 0, file_size
    path, _, rest = str(name).partition(":")
    start_text, _, end_text = rest.partition(":")
    if path != "." or not start_text.isdigit() or not end_text.isdigit():
        raise ValueError(f"shard {str(name)[:40]!r} is not a shard of this one file")
    return int(start_text), int(end_text)
