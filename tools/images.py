"""Image inputs: validate the references a question carries, read them for a model, record them for traces.

An image is referenced, never carried: the input's `images` is a list of strings, each a local file path, an
http(s) URL, or a `data:image/...;base64,...` URI. The graph state keeps those strings; pixels are read only
where a model is called (`as_url` for OpenAI-compatible servers, `as_pil` for in-process models), and traces keep
`image_record`s: the reference as given (a data URI replaced by `data:<mime>;sha256=<hash>`) and the sha256 of
the image's bytes, never the bytes.

A DICOM file (`.dcm`, or the `DICM` marker at byte 128) is read with pydicom (optional: `pip install pydicom`)
and sent as a PNG: its first frame, through the file's modality and VOI (window) lookup tables, scaled to 8 bits.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from langchain_core.messages import BaseMessage

from ermedrag.agents.base import message_images

MAX_IMAGES = 8  # per question (the specialists each see them all: the prompt grows with every image)
MAX_REFERENCE_CHARS = 4096  # a path or URL
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one file or decoded data URI (OpenAI's own limit per image)
MAX_DATA_URI_CHARS = 64 + 4 * (MAX_IMAGE_BYTES // 3 + 1)
MAX_DATA_HEADER_CHARS = 128  # `data:image/png;base64` and the like
MAX_IMAGE_PIXELS = 50_000_000  # width × height: a decompression bomb is refused before it is decoded
SERVER_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")  # sent as they are; others as PNG
DICOM_MARKER_OFFSET = 128
HASH_CHUNK_BYTES = 1 << 20


class ImageInputError(ValueError):
    """An image reference that is not a readable image; the message names the field, the item and the fix."""


@dataclass(frozen=True)
class ImageData:
    """One image's bytes as a model receives them (`mime`, `data`: a DICOM already rendered to PNG)."""

    mime: str
    data: bytes


def is_url(reference: str) -> bool:
    return reference[:8].lower().startswith(("http://", "https://"))


def is_data_uri(reference: str) -> bool:
    return reference[:5].lower() == "data:"


def _label(index: int, reference: str, field: str) -> str:
    """How an error names an item: its position and its start (a data URI by its header only)."""
    limit = 40 if is_data_uri(reference) else 80
    shown = reference if len(reference) <= limit else reference[:limit - 3] + "..."
    return f"input {field!r} item {index + 1} ({shown!r})"


# ------------------------------------------------------------------------------------------------ validation


def validate_images(value: Any, field: str = "images") -> list[str]:
    """The input's image references, each checked (a file that exists and is an image, an http(s) URL of the
    right shape, a base64 `data:image/*` URI that decodes to an image), or an `ImageInputError` naming the field
    and the item. None and [] are no images."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ImageInputError(f"input {field!r} must be a list of strings (file paths, http(s) URLs or data URIs), "
                              f"got {type(value).__name__}")
    if len(value) > MAX_IMAGES:
        raise ImageInputError(f"input {field!r} has {len(value)} images; at most {MAX_IMAGES}")
    references = []
    for index, reference in enumerate(value):
        if not isinstance(reference, str):
            raise ImageInputError(f"input {field!r} item {index + 1} must be a string (a file path, an http(s) URL "
                                  f"or a data URI), got {type(reference).__name__}")
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
        raise ImageInputError(f"{where}: {len(reference)} characters; a path or URL has at most "
                              f"{MAX_REFERENCE_CHARS}")
    if is_url(reference):
        parts = urlsplit(reference)
        if not parts.hostname or any(ch.isspace() for ch in reference):
            raise ImageInputError(f"{where}: not a valid http(s) URL (no host, or spaces in it)")
        return
    if "://" in reference[:32]:
        raise ImageInputError(f"{where}: unsupported scheme; give a file path, an http(s) URL or a "
                              "data:image/...;base64 URI")
    _read_file(reference, where)  # raises when it is missing, too large or not an image


def _decode_data_uri(reference: str, where: str) -> ImageData:
    if len(reference) > MAX_DATA_URI_CHARS:
        raise ImageInputError(f"{where}: a data URI of {len(reference)} characters; at most {MAX_DATA_URI_CHARS} "
                              f"({MAX_IMAGE_BYTES // (1024 * 1024)} MB of image)")
    comma = reference.find(",", 0, MAX_DATA_HEADER_CHARS)
    header = reference[5:comma].strip().lower() if comma > 0 else ""
    mime, _, encoding = header.partition(";")
    if comma < 0 or not mime.startswith("image/") or encoding.strip() != "base64":
        raise ImageInputError(f"{where}: a data URI must look like 'data:image/png;base64,...' (an image/* type, "
                              "base64-encoded)")
    try:
        data = base64.b64decode(reference[comma + 1:], validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageInputError(f"{where}: the data URI's payload is not valid base64 ({err})") from None
    _check_image_bytes(data, where)
    return ImageData(mime=mime.strip(), data=data)


def _read_file(reference: str, where: str) -> ImageData:
    """The file's bytes as a model gets them: an image file as it is, a DICOM file rendered to PNG."""
    path = Path(reference).expanduser()
    try:
        size = path.stat().st_size
    except OSError as err:
        raise ImageInputError(f"{where}: no such file ({err.strerror or err}); give an existing image file, an "
                              "http(s) URL or a data URI") from None
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
    return data[DICOM_MARKER_OFFSET:DICOM_MARKER_OFFSET + 4] == b"DICM"


def _open_image(data: bytes, where: str) -> Any:
    """A PIL image of `data` (not yet decoded), or an error naming the item. Size is checked before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageInputError(f"{where}: not a readable image ({type(err).__name__}: {str(err)[:120]}); PNG, JPEG, "
                              "GIF, WebP, TIFF, BMP or DICOM") from None
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
    window when it has one, then min-max scaling; MONOCHROME1 (white = low) is inverted."""
    try:
        import pydicom
        from pydicom.pixels import apply_modality_lut, apply_voi_lut
    except ImportError:
        raise ImageInputError(f"{where}: a DICOM file needs pydicom: pip install pydicom") from None
    import numpy as np
    from PIL import Image

    try:
        dataset = pydicom.dcmread(io.BytesIO(data))
        rows, columns = int(dataset.Rows), int(dataset.Columns)
        if rows * columns > MAX_IMAGE_PIXELS:
            raise ImageInputError(f"{where}: {columns}x{rows} pixels; at most {MAX_IMAGE_PIXELS} pixels")
        pixels = dataset.pixel_array
        frames = int(getattr(dataset, "NumberOfFrames", 1) or 1)
        samples = int(getattr(dataset, "SamplesPerPixel", 1) or 1)
        if frames > 1:
            pixels = pixels[0]
        if samples == 1:
            pixels = apply_voi_lut(apply_modality_lut(pixels, dataset), dataset).astype("float64")
            low, high = float(pixels.min()), float(pixels.max())
            pixels = (pixels - low) / (high - low) * 255.0 if high > low else np.zeros_like(pixels)
            if str(getattr(dataset, "PhotometricInterpretation", "")).upper() == "MONOCHROME1":
                pixels = 255.0 - pixels
            image = Image.fromarray(pixels.round().astype("uint8"), mode="L")
        else:  # colour: pydicom has already converted YBR to RGB
            image = Image.fromarray(np.asarray(pixels).astype("uint8")).convert("RGB")
    except ImageInputError:
        raise
    except Exception as err:  # noqa: BLE001 - pydicom raises many kinds for damaged files
        raise ImageInputError(f"{where}: a DICOM file without readable pixels ({type(err).__name__}: "
                              f"{str(err)[:120]})") from None
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


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


# ------------------------------------------------------------------------------------------------- traces


def image_record(reference: str) -> dict[str, str | None]:
    """What a trace keeps of an image: the reference as given (a data URI as `data:<mime>;sha256=<hash>`) and
    the sha256 of its bytes (of the file as it is on disk; None for a URL, whose bytes only the server sees)."""
    if is_data_uri(reference):
        image = image_data(reference)
        digest = hashlib.sha256(image.data).hexdigest()
        return {"ref": f"data:{image.mime};sha256={digest}", "sha256": digest}
    if is_url(reference):
        return {"ref": reference, "sha256": None}
    path = Path(reference).expanduser()
    stat = path.stat()
    return {"ref": reference, "sha256": _file_sha256(str(path.resolve()), stat.st_mtime_ns, stat.st_size)}


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


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={value!r} must be true or false")
