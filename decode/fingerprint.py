"""An artifact's identity, by content: a model's weights or a trigram's tables, wherever the directory lies.

A plan and a cached measurement hold the fingerprints of the models they were made with; a run directory copied or
moved elsewhere keeps them. Hashing a model's weights reads them once: the digest is kept (by the file's path, size
and modification time) in the user's cache, so later runs read a few bytes instead. A file is checked as it is
hashed, so a damaged copy is named as such rather than as another model.
"""
import hashlib
import json
import os
import struct
import zipfile
from pathlib import Path

from decode.errors import InputError, check_path

CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "staged-speculative"
DIGESTS = CACHE_ROOT / "digests"
WEIGHTS, TABLES = "*.safetensors", "*.npz"
CHUNK = 1 << 24


def fingerprint(directory, pattern: str = WEIGHTS) -> str:
    """The identity of the files matching `pattern` in `directory`: their names and contents."""
    directory = Path(directory)
    check_path(directory, True, "model directory", "pass the directory that holds the model")
    files = sorted(directory.glob(pattern))
    if not files:
        raise InputError(f"{directory} holds no {pattern} files: it is damaged or not what it should be; copy it again "
                         f"or rebuild it")
    digests = [(f.name, content_digest(f)) for f in files]
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:16]


def content_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, checked first (check_file); kept by path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    kept = DIGESTS / key
    try:
        return kept.read_text().strip()
    except OSError:
        pass
    check_file(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    try:
        DIGESTS.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f".{key}.{os.getpid()}")
        tmp.write_text(digest.hexdigest())
        os.replace(tmp, kept)
    except OSError:  # an unwritable cache only costs the next run another read
        pass
    return digest.hexdigest()


def check_file(path: Path) -> None:
    """A safetensors file whose header and size agree, or a .npz whose members are whole; InputError naming the
    damage otherwise."""
    damaged = lambda why: InputError(f"{path} is damaged ({why}); copy it again or rebuild it")
    if path.suffix == ".safetensors":
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > size - 8:
                raise damaged(f"{size} bytes hold no complete safetensors header")
            try:
                header = json.loads(f.read(length))
                end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError):
                raise damaged("its safetensors header is not valid") from None
        if size != 8 + length + end:
            raise damaged(f"{size} bytes where its header describes {8 + length + end}")
    elif path.suffix == ".npz":
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as err:
            raise damaged(str(err)) from None
        if bad is not None:
            raise damaged(f"its member {bad} fails its checksum")
