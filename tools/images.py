"""Image inputs: validate the references a question carries, read them for a model, record them for traces.

An image is referenced, never carried: the input's `images` is a list of strings, each a local file path, an
http(s) URL, or a `data:image/...;base64,...` URI. A data URI is written once to the image cache
(`cache_data_uris`: `<ERMEDRAG_HOME>/images/<sha256>.<ext>`, content-addressed, reused by reruns) and the graph
state and its fan-out tasks keep the file's path, so no checkpoint or task carries the base64. Pixels are read
only where a model is called (`as_url` for OpenAI-compatible servers, `as_pil` for in-process models), and traces
keep `image_record`s: the reference as given (a data URI, or its cached file, as `data:<mime>;sha256=<hash>`) and
the sha256 of the image's bytes, never the bytes.

A file path is read only inside the allowed image folders (`image_roots`): env ERMEDRAG_IMAGE_ROOTS
(os.pathsep-separated folders; `/` allows every path), by default the working directory and the system temp
folder, and always the image cache. Paths are resolved (symlinks followed) before the check, and a path outside
them gets the same error as a missing file, so a Studio user cannot probe the server's files.

A DICOM file (`.dcm`, or the `DICM` marker at byte 128) is read with pydicom (optional: `pip install pydicom`)
and sent as a PNG: its first frame, through the file's modality and VOI (window) lookup tables, scaled to 8 bits.
Its header is read first: the deflated transfer syntax is refused (it inflates without bound) and the pixel data
it declares must fit MAX_DICOM_PIXEL_BYTES; then only the first frame is decoded.
URLs are checked for shape only and never fetched here: a server fetches them itself; the in-process backend
refuses them (a Studio deployment must not fetch arbitrary URLs on a user's behalf).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from langchain_core.messages import BaseMessage

from ermedrag.tools import settings
from ermedrag.agents.base import message_images
from ermedrag.tools.settings import cache_home

MAX_IMAGES = 8  # per question (the specialists each see them all: the prompt grows with every image)
MAX_REFERENCE_CHARS = 4096  # a path or URL
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one file or decoded data URI (OpenAI's own limit per image)
MAX_DATA_URI_CHARS = 64 + 4 * (MAX_IMAGE_BYTES // 3 + 1)
MAX_DATA_HEADER_CHARS = 128  # `data:image/png;base64` and the like
MAX_IMAGE_PIXELS = 50_000_000  # width × height: a decompression bomb is refused before it is decoded
SERVER_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")  # sent as they are; others as PNG
DICOM_MARKER_OFFSET = 128
# What a DICOM header may declare (rows × columns × frames × samples × bytes per sample), checked before any pixel
# is decoded: a compressed file's frames decode to what the header says. 256 MB holds a 500-slice 512×512 CT.
MAX_DICOM_PIXEL_BYTES = 256 * 1024 * 1024
DEFLATED_TRANSFER_SYNTAX = "1.2.840.10008.1.2.1.99"  # the whole dataset zlib-compressed: pydicom inflates it at once
HASH_CHUNK_BYTES = 1 << 20
IMAGE_ROOTS_ENV = "ERMEDRAG_IMAGE_ROOTS"
MAX_IMAGE_ROOTS = 64
# A cached data URI's file extension by its declared type, and back (the trace names the type it was given as).
CACHE_EXTENSIONS = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
    "image/tiff": "tiff",
    "image/bmp": "bmp",
}
CACHE_MIME_TYPES = {ext: mime for mime, ext in CACHE_EXTENSIONS.items()}
OTHER_IMAGE_EXTENSION = "img"  # a type outside CACHE_EXTENSIONS: the trace reads the type from the bytes


class ImageInputError(ValueError):
    """An image reference that is not a readable image; the message names the field, the item and the fix."""


@dataclass(frozen=True)
class ImageData:
    """One image's bytes as a model receives them (`mime`, `data`: a DICOM already rendered to PNG)."""

    mime: str
    data: bytes


class ImagesNotSupportedError(ValueError):
    """Images sent to (or configured for) a model that cannot see them. Raised before any weights load."""


def is_url(reference: str) -> bool:
    return reference[:8].lower().startswith(("http://", "https://"))


def is_data_uri(reference: str) -> bool:
    return reference[:5].lower() == "data:"


def _label(index: int, reference: str, field: str) -> str:
    """How an error names an item: its position and its start (a data URI by its header only)."""
    limit = 40 if is_data_uri(reference) else 80
    shown = reference if len(reference) <= limit else reference[: limit - 3] + "..."
    return f"input {field!r} item {index + 1} ({shown!r})"


# ------------------------------------------------------------------------------------------------ validation


def validate_images(value: Any, field: str = "images") -> list[str]:
    """The input's image references, each checked (a file that exists and is an image, an http(s) URL of the
    right shape, a base64 `data:image/*` URI that decodes to an image), or an `ImageInputError` naming the field
    and the item. None and [] are no images."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ImageInputError(
            f"input {field!r} must be a list of strings (file paths, http(s) URLs or data URIs), "
            f"got {type(value).__name__}"
        )
    if len(value) > MAX_IMAGES:
        raise ImageInputError(f"input {field!r} has {len(value)} images; at most {MAX_IMAGES}")
    references = []
    for index, reference in enumerate(value):
        if not isinstance(reference, str):
            raise ImageInputError(
                f"input {field!r} item {index + 1} must be a string (a file path, an http(s) URL "
                f"or a data URI), got {type(reference).__name__}"
            )
        if not reference.strip():
            raise ImageInputError(f"input {field!r} item {index + 1} is empty")
        _check_reference(index, reference, field)
        references.append(reference)
    return references


def _check_reference(index: int, reference: str, field: str) -> None:
    where = _label(index, reference, field)
    if is_data_uri(reference):
        _decode_data_uri(reference, where)  # raises when it is not a base64 image
        return
    if len(reference) > MAX_REFERENCE_CHARS:
        raise ImageInputError(f"{where}: {len(reference)} characters; a path or URL has at most {MAX_REFERENCE_CHARS}")
    if is_url(reference):
        parts = urlsplit(reference)
        if not parts.hostname or any(ch.isspace() for ch in reference):
            raise ImageInputError(f"{where}: not a valid http(s) URL (no host, or spaces in it)")
        return
    if "://" in reference[:32]:
        raise ImageInputError(
            f"{where}: unsupported scheme; give a file path, an http(s) URL or a data:image/...;base64 URI"
        )
    _read_file(reference, where)  # raises when it is missing, too large or not an image


def _decode_data_uri(reference: str, where: str) -> ImageData:
    image = _parse_data_uri(reference, where)
    _check_image_bytes(image.data, where)
    return image


def _parse_data_uri(reference: str, where: str) -> ImageData:
    """A data URI's declared type and decoded bytes (not yet checked to be an image)."""
    if len(reference) > MAX_DATA_URI_CHARS:
        raise ImageInputError(
            f"{where}: a data URI of {len(reference)} characters; at most {MAX_DATA_URI_CHARS} "
            f"({MAX_IMAGE_BYTES // (1024 * 1024)} MB of image)"
        )
    comma = reference.find(",", 0, MAX_DATA_HEADER_CHARS)
    header = reference[5:comma].strip().lower() if comma > 0 else ""
    mime, _, encoding = header.partition(";")
    if comma < 0 or not mime.startswith("image/") or encoding.strip() != "base64":
        raise ImageInputError(
            f"{where}: a data URI must look like 'data:image/png;base64,...' (an image/* type, base64-encoded)"
        )
    try:
        data = base64.b64decode(reference[comma + 1 :], validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageInputError(f"{where}: the data URI's payload is not valid base64 ({err})") from None
    return ImageData(mime=mime.strip(), data=data)


def image_roots() -> list[Path]:
    """The folders whose files (in any subfolder) an input may name: env ERMEDRAG_IMAGE_ROOTS (os.pathsep-separated;
    `/` allows every path), by default the working directory and the system temp folder; always the image cache
    (where `cache_data_uris` writes). Read at each call, resolved (symlinks followed)."""
    configured = [entry for entry in settings.read(IMAGE_ROOTS_ENV).split(os.pathsep) if entry.strip()]
    folders = configured[:MAX_IMAGE_ROOTS] or [os.getcwd(), tempfile.gettempdir()]
    try:
        return [Path(folder).expanduser().resolve() for folder in folders] + [image_cache_dir().resolve()]
    except (OSError, RuntimeError, ValueError) as err:  # an unknown ~user, a symlink loop, a NUL byte
        raise ValueError(f"environment variable {IMAGE_ROOTS_ENV}: a folder that cannot be resolved ({err})") from None


def allowed_file(reference: str, where: str) -> tuple[Path, int]:
    """The resolved path of an existing file or folder under `image_roots()`, and its size. A path that is
    missing, unreadable or outside the roots (also through a symlink) gets one and the same error: no answer
    tells a caller whether a file exists outside them."""
    roots = image_roots()
    try:
        path = Path(reference).expanduser().resolve()
        inside = any(path.is_relative_to(root) for root in roots)
        size = path.stat().st_size if inside else -1
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, an unknown ~user, a NUL byte
        size = -1
    if size < 0:
        raise ImageInputError(
            f"{where}: no such file in the allowed image folders (env {IMAGE_ROOTS_ENV}, "
            "os.pathsep-separated; default: the working directory and the temp folder); give an "
            "existing image file there, an http(s) URL or a data URI"
        )
    return path, size


def _read_file(reference: str, where: str) -> ImageData:
    """The file's bytes as a model gets them: an image file as it is, a DICOM file rendered to PNG."""
    path, size = allowed_file(reference, where)
    if not path.is_file():
        raise ImageInputError(f"{where}: not a file")
    if size > MAX_IMAGE_BYTES:
        raise ImageInputError(f"{where}: {size} bytes; an image has at most {MAX_IMAGE_BYTES} bytes")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ImageInputError(f"{where}: cannot be read ({err.strerror or err})") from None
    if is_dicom(data):
        return ImageData(mime="image/png", data=_dicom_to_png(data, where))
    _check_image_bytes(data, where)
    return ImageData(mime=_mime_of(data), data=data)


def is_dicom(data: bytes) -> bool:
    return data[DICOM_MARKER_OFFSET : DICOM_MARKER_OFFSET + 4] == b"DICM"


def _open_image(data: bytes, where: str) -> Any:
    """A PIL image of `data` (not yet decoded), or an error naming the item. Size is checked before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageInputError(
            f"{where}: not a readable image ({type(err).__name__}: {str(err)[:120]}); PNG, JPEG, "
            "GIF, WebP, TIFF, BMP or DICOM"
        ) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageInputError(f"{where}: {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels")
    return image


def _check_image_bytes(data: bytes, where: str) -> None:
    image = _open_image(data, where)
    try:
        image.verify()  # reads the whole stream: a truncated or corrupt file fails here, not in the model
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for corrupt data
        raise ImageInputError(f"{where}: a damaged image ({type(err).__name__}: {str(err)[:120]})") from None


def _mime_of(data: bytes) -> str:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    return Image.MIME.get(image.format or "", "application/octet-stream")


def _dicom_to_png(data: bytes, where: str) -> bytes:
    """The DICOM's first frame as an 8-bit PNG: modality LUT (rescale to real units), then the file's VOI LUT or
    window when it has one, then min-max scaling; MONOCHROME1 (white = low) is inverted. The header is checked
    (`_dicom_header`) before any pixel is decoded, and only the first frame is."""
    try:
        from pydicom.pixels import apply_modality_lut, apply_voi_lut, pixel_array
    except ImportError:
        raise ImageInputError(f"{where}: a DICOM file needs pydicom: pip install pydicom") from None
    import numpy as np
    from PIL import Image

    try:
        header = _dicom_header(data, where)
        pixels = pixel_array(io.BytesIO(data), index=0)  # a file-like source: pydicom reads the one frame it decodes
        if int(getattr(header, "SamplesPerPixel", 1) or 1) == 1:
            pixels = apply_voi_lut(apply_modality_lut(pixels, header), header).astype("float64")
            low, high = float(pixels.min()), float(pixels.max())
            pixels = (pixels - low) / (high - low) * 255.0 if high > low else np.zeros_like(pixels)
            if str(getattr(header, "PhotometricInterpretation", "")).upper() == "MONOCHROME1":
                pixels = 255.0 - pixels
            image = Image.fromarray(pixels.round().astype("uint8"), mode="L")
        else:  # colour: pydicom has already converted YBR to RGB
            image = Image.fromarray(np.asarray(pixels).astype("uint8")).convert("RGB")
    except ImageInputError:
        raise
    except Exception as err:  # noqa: BLE001 - pydicom raises many kinds for damaged files
        raise ImageInputError(
            f"{where}: a DICOM file without readable pixels ({type(err).__name__}: {str(err)[:120]})"
        ) from None
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _dicom_header(data: bytes, where: str) -> Any:
    """The DICOM dataset without its pixel data, once its transfer syntax and declared size are acceptable: the
    deflated syntax is refused (pydicom inflates the whole dataset in memory, even to read the header), and
    rows × columns × frames × samples × bytes per sample must fit MAX_DICOM_PIXEL_BYTES (a compressed frame
    decodes to what the header declares), one frame MAX_IMAGE_PIXELS."""
    import pydicom

    # The public read_file_meta_info takes only a file name; the file is already in memory (its size checked).
    from pydicom.filereader import _read_file_meta_info, read_preamble

    source = io.BytesIO(data)
    read_preamble(source, False)
    syntax = str(_read_file_meta_info(source).get("TransferSyntaxUID", "") or "")
    if syntax == DEFLATED_TRANSFER_SYNTAX:
        raise ImageInputError(
            f"{where}: a DICOM file in the deflated transfer syntax ({syntax}) is not read (it "
            "inflates without bound before its size is known); convert it to an uncompressed or "
            "JPEG transfer syntax first"
        )
    header = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    sizes = {
        name: _header_count(header, name, default, where)
        for name, default in (
            ("Rows", None),
            ("Columns", None),
            ("NumberOfFrames", 1),
            ("SamplesPerPixel", 1),
            ("BitsAllocated", 8),
        )
    }
    rows, columns, frames, samples, bits = sizes.values()
    if rows * columns > MAX_IMAGE_PIXELS:
        raise ImageInputError(f"{where}: {columns}x{rows} pixels; at most {MAX_IMAGE_PIXELS} pixels")
    declared = rows * columns * frames * samples * -(-bits // 8)
    if declared > MAX_DICOM_PIXEL_BYTES:
        raise ImageInputError(
            f"{where}: the DICOM header declares {declared} bytes of pixel data ({frames} "
            f"frame(s) of {columns}x{rows}, {samples} sample(s) of {bits} bits); at most "
            f"{MAX_DICOM_PIXEL_BYTES} (MAX_DICOM_PIXEL_BYTES)"
        )
    return header


def _header_count(header: Any, name: str, default: int | None, where: str) -> int:
    """A positive integer of the DICOM header (Rows, NumberOfFrames, ...), or an error naming the element."""
    value = header.get(name)
    if value is None or value == "":
        if default is None:
            raise ImageInputError(f"{where}: a DICOM header without {name}")
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ImageInputError(f"{where}: a DICOM header whose {name} is not a number ({str(value)[:40]!r})") from None
    if number < 1:
        raise ImageInputError(f"{where}: a DICOM header whose {name} is {number}")
    return number


# ---------------------------------------------------------------------------------------- reading for models


def image_data(reference: str) -> ImageData:
    """The bytes a model receives for a file or data URI reference (an `ImageInputError` for a URL or a file
    that went missing since validation)."""
    where = f"image {reference[:80]!r}" if not is_data_uri(reference) else "image (data URI)"
    if is_data_uri(reference):
        return _decode_data_uri(reference, where)
    if is_url(reference):
        raise ImageInputError(f"{where}: a URL is fetched by the model server, never here")
    return _read_file(reference, where)


def as_url(reference: str) -> str:
    """What an OpenAI-compatible server receives as `image_url.url`: an http(s) URL as it is (the server fetches
    it), a data URI as it is, a file as a base64 data URI (PNG, JPEG, GIF, WebP as they are; other formats and
    DICOM as PNG)."""
    if is_url(reference) or (is_data_uri(reference) and reference[5:].lower().startswith(SERVER_IMAGE_TYPES)):
        return reference
    image = image_data(reference)
    if image.mime not in SERVER_IMAGE_TYPES:
        image = ImageData(mime="image/png", data=_to_png(image.data))
    return f"data:{image.mime};base64,{base64.b64encode(image.data).decode('ascii')}"


def _to_png(data: bytes) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as image:
        image.convert("RGBA" if "A" in image.getbands() else "RGB").save(out, format="PNG")
    return out.getvalue()


def as_pil(reference: str) -> Any:
    """The image as an RGB PIL image, for an in-process vision-language model's processor."""
    from PIL import Image

    image = image_data(reference)
    with Image.open(io.BytesIO(image.data)) as opened:
        return opened.convert("RGB")


def images_in(messages: Sequence[BaseMessage]) -> list[str]:
    """Every image reference in `messages`, in order."""
    return [ref for message in messages for ref in message_images(message)]


# -------------------------------------------------------------------------------------------- image cache


def image_cache_dir() -> Path:
    """Where data URIs are kept as files: <ERMEDRAG_HOME, default ~/.cache/ermedrag>/images."""
    return cache_home() / "images"


def cache_data_uris(references: Sequence[str]) -> list[str]:
    """`references` (already validated) with each data URI replaced by the path of its bytes in the image cache:
    `<image_cache_dir>/<sha256>.<ext>`, written once (atomically) and reused by every later run with the same
    image. Paths and URLs stay as they are. The state and tasks of a graph then carry a short path, not
    megabytes of base64, and a trace still records the image as `data:<mime>;sha256=<hash>` (`image_record`)."""
    return [
        str(_cached_file(_parse_data_uri(ref, "image (data URI)"))) if is_data_uri(ref) else ref for ref in references
    ]


def _cached_file(image: ImageData) -> Path:
    digest = hashlib.sha256(image.data).hexdigest()
    folder = image_cache_dir()
    path = folder / f"{digest}.{CACHE_EXTENSIONS.get(image.mime, OTHER_IMAGE_EXTENSION)}"
    try:
        if path.is_file() and path.stat().st_size == len(image.data):
            return path  # the same name is the same bytes: content-addressed
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{digest[:16]}-", suffix=".part")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(image.data)
            os.replace(temporary, path)  # atomic: a concurrent reader sees the whole file or none
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise ImageInputError(
            f"image (data URI): cannot be written to the image cache {folder} "
            f"({err.strerror or err}); set ERMEDRAG_HOME to a writable folder"
        ) from None
    return path


def _cached_mime(path: Path) -> str | None:
    """The type a cached data URI was given as, when `path` (resolved) is a file of the image cache; else None."""
    if path.parent != image_cache_dir().resolve():
        return None
    digest, _, extension = path.name.partition(".")
    if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
        return None
    return CACHE_MIME_TYPES.get(extension) or _mime_of(path.read_bytes())


# ------------------------------------------------------------------------------------------------- traces


def image_record(reference: str) -> dict[str, str | None]:
    """What a trace keeps of an image: the reference as given (a data URI as `data:<mime>;sha256=<hash>`, also
    once it is a file of the image cache: `cache_data_uris`) and the sha256 of its bytes (of the file as it is on
    disk; None for a URL, whose bytes only the server sees)."""
    if is_data_uri(reference):
        image = _parse_data_uri(reference, "image (data URI)")
        digest = hashlib.sha256(image.data).hexdigest()
        return {"ref": f"data:{image.mime};sha256={digest}", "sha256": digest}
    if is_url(reference):
        return {"ref": reference, "sha256": None}
    path, size = allowed_file(reference, f"image {reference[:80]!r}")
    digest = _file_sha256(str(path), path.stat().st_mtime_ns, size)
    cached_as = _cached_mime(path)
    return {"ref": f"data:{cached_as};sha256={digest}" if cached_as else reference, "sha256": digest}


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    """Keyed by modification time and size too: N specialists reading one file hash it once, an edited file anew."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for _ in range(size // HASH_CHUNK_BYTES + 2):  # bounded: the file's size when it was looked at
            chunk = handle.read(HASH_CHUNK_BYTES)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def recorded_message(message: BaseMessage) -> dict[str, Any]:
    """A message as a trace event stores it: role and text, and its images as `image_record`s (no pixels)."""
    record: dict[str, Any] = {"role": message.type, "content": message.text}
    references = message_images(message)
    if references:
        record["images"] = [image_record(ref) for ref in references]
    return record
