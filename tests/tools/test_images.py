"""Images in the MMedAgent-RL graph: validation, trace records (no pixels), the OpenAI-compatible request against
a real server on 127.0.0.1, a tiny randomly initialised vision-language model through the hf backend, and the
refusal of every model that cannot see.

The images are real medical images from installed packages: pydicom's CT and MR test files (DICOM, sent as PNG)
and scikit-image's retina photograph and immunohistochemistry slide (both in the `dev` extra). Hostile inputs are
real files too: DICOMs written here with pydicom (multi-frame, deflated), paths outside the allowed folders and
symlinks out of them."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from ermedrag.agents.base import message_images, with_images
from ermedrag.graphs.mmedagent.graph import builder, graph
from ermedrag.tools import images
from ermedrag.tools.models import hf as hf_backend
from ermedrag.tools.models.hf import HFChatModel
from ermedrag.tools.models import ImagesNotSupportedError, load_chat_model
from ermedrag.tools.images import (
    IMAGE_ROOTS_ENV,
    MAX_IMAGES,
    ImageInputError,
    as_url,
    image_data,
    image_record,
    validate_images,
)
from ermedrag.tools.records.traces import TraceStore

pydicom = pytest.importorskip("pydicom", reason="real DICOM test images: pip install pydicom")
pydicom_data = pytest.importorskip("pydicom.data", reason="real DICOM test images: pip install pydicom")
skimage_data = pytest.importorskip("skimage.data", reason="real medical test images: pip install scikit-image")

PANEL = "scripted:ermedrag.testing.scripted.panel"
OPTIONS = {"A": "Pneumothorax", "B": "Normal study", "C": "Fracture", "D": "Effusion"}
MAX_BODY_BYTES = 32 * 1024 * 1024


@pytest.fixture(scope="module")
def medical(tmp_path_factory) -> dict[str, Path]:
    """Real medical images: CT and MR DICOM files as installed, a retina photograph (PNG) and an
    immunohistochemistry slide (JPEG), shrunk so each request stays small."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("medical")
    retina, ihc = folder / "retina.png", folder / "ihc.jpg"
    Image.fromarray(skimage_data.retina()).resize((96, 96)).save(retina)
    Image.fromarray(skimage_data.immunohistochemistry()).resize((64, 64)).save(ihc, quality=90)
    return {
        "ct": Path(pydicom_data.get_testdata_file("CT_small.dcm")),
        "mr": Path(pydicom_data.get_testdata_file("MR_small.dcm")),
        "retina": retina,
        "ihc": ihc,
    }


def data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


@pytest.fixture
def image_home(tmp_path, monkeypatch) -> Path:
    """A fresh ERMEDRAG_HOME: the image cache (data URIs written as files) is <home>/images."""
    home = tmp_path / "home"
    monkeypatch.setenv("ERMEDRAG_HOME", str(home))
    return home


# ------------------------------------------------------------------------------------------------ validation


def test_valid_references_are_kept_as_given(medical):
    refs = [
        str(medical["ct"]),
        str(medical["retina"]),
        str(medical["ihc"]),
        data_uri(medical["retina"], "image/png"),
        "https://example.org/chest.png",
    ]
    assert validate_images(refs) == refs
    assert validate_images(None) == [] and validate_images([]) == []


@pytest.mark.parametrize(
    "value, message",
    [
        ("x.png", "must be a list of strings"),
        ([1], "item 1 must be a string"),
        (["  "], "item 1 is empty"),
        (["{missing}"], "item 1 .*no such file in the allowed image folders .*ERMEDRAG_IMAGE_ROOTS"),
        (["{folder}"], "item 1 .*not a file"),
        (["{text}"], "item 1 .*not a readable image"),
        (["{truncated}"], "item 1 .*damaged image"),
        (["{retina}", "data:text/plain;base64,aGVsbG8="], "item 2 .*data:image/png;base64"),
        (["data:image/png;base64,@@not base64@@"], "item 1 .*not valid base64"),
        (["data:image/png;base64," + base64.b64encode(b"not an image").decode()], "item 1 .*not a readable image"),
        (["data:image/png," + "x" * 10], "item 1 .*base64"),
        (["ftp://example.org/x.png"], "item 1 .*unsupported scheme"),
        (["https:///no-host.png"], "item 1 .*not a valid http"),
        (["/" + "a" * 5000], "item 1 .*at most 4096"),
        (["{retina}"] * (MAX_IMAGES + 1), f"at most {MAX_IMAGES}"),
    ],
)
def test_bad_references_are_refused_naming_the_field_and_item(value, message, medical, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "cut.png").write_bytes(medical["retina"].read_bytes()[:300])
    names = {
        "missing": tmp_path / "missing.png",
        "folder": tmp_path / "folder",
        "text": tmp_path / "notes.txt",
        "truncated": tmp_path / "cut.png",
        "retina": medical["retina"],
    }
    if isinstance(value, list):
        value = [v.format(**names) if isinstance(v, str) and v.startswith("{") else v for v in value]
    with pytest.raises(ImageInputError, match=f"input 'images' {message}" if "item" in message else message):
        validate_images(value)


def test_dicom_is_sent_as_a_png_of_its_pixels(medical):
    from PIL import Image

    for name in ("ct", "mr"):
        dicom = pydicom.dcmread(medical[name])
        url = as_url(str(medical[name]))
        assert url.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert image.format == "PNG" and image.mode == "L" and image.size == (dicom.Columns, dicom.Rows)
        assert len(set(image.tobytes())) > 50  # windowed and scaled: real contrast, not a flat image


def write_dicom(path: Path, frames: list[Any], syntax: str) -> Path:
    """A secondary-capture DICOM of 16-bit grey `frames` (numpy arrays, one shape) in transfer syntax `syntax`."""
    import numpy as np
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    meta.TransferSyntaxUID = syntax
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PhotometricInterpretation = "OT", "MONOCHROME2"
    ds.Rows, ds.Columns = frames[0].shape
    ds.NumberOfFrames, ds.SamplesPerPixel = len(frames), 1
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    ds.PixelData = np.stack(frames).astype("<u2").tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


def test_multi_frame_dicom_over_the_declared_size_limit_is_refused_naming_the_file_and_limit(tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image
    from pydicom.uid import ExplicitVRLittleEndian

    gradient = np.tile(np.arange(64, dtype="uint16") * 100, (64, 1))  # frame 0; the others are flat
    path = write_dicom(tmp_path / "cine.dcm", [gradient] + [np.full((64, 64), 7, "uint16")] * 3, ExplicitVRLittleEndian)
    declared = 4 * 64 * 64 * 2
    monkeypatch.setattr(images, "MAX_DICOM_PIXEL_BYTES", declared - 1)
    with pytest.raises(ImageInputError) as refused:
        validate_images([str(path)])
    message = str(refused.value)
    assert f"item 1 ('{str(path)[:40]}" in message  # the file, by the start of its path
    assert f"declares {declared} bytes" in message and "4 frame(s) of 64x64" in message
    assert f"at most {declared - 1} (MAX_DICOM_PIXEL_BYTES)" in message
    monkeypatch.setattr(images, "MAX_DICOM_PIXEL_BYTES", declared)  # at the limit: read, first frame only
    decoded: list[int | None] = []
    real_pixel_array = pydicom.pixels.pixel_array

    def recording_pixel_array(src: Any, **kwargs: Any) -> Any:
        decoded.append(kwargs.get("index"))
        return real_pixel_array(src, **kwargs)

    monkeypatch.setattr(pydicom.pixels, "pixel_array", recording_pixel_array)
    png = Image.open(io.BytesIO(image_data(str(path)).data))
    assert decoded == [0]  # one decode, of frame 0 alone
    assert png.size == (64, 64) and len(set(png.tobytes())) == 64  # the gradient of frame 0, not a flat frame


def test_deflated_dicom_is_refused_before_it_is_inflated(tmp_path, medical):
    import numpy as np
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    bomb = write_dicom(tmp_path / "bomb.dcm", [np.zeros((2048, 2048), "uint16")] * 4, DeflatedExplicitVRLittleEndian)
    assert bomb.stat().st_size < 100_000  # 32 MB of pixels in the file's few kilobytes
    real = Path(pydicom_data.get_testdata_file("image_dfl.dcm"))  # pydicom's own deflated test file
    for path in (bomb, real):
        with pytest.raises(ImageInputError) as refused:
            validate_images([str(path)])
        assert f"item 1 ('{str(path)[:40]}" in str(refused.value)  # the file, by the start of its path
        assert "a DICOM file in the deflated transfer syntax (1.2.840.10008.1.2.1.99) is not read" in str(refused.value)
    assert validate_images([str(medical["ct"]), str(medical["mr"])])  # the real CT and MR files still read


def _refusal(reference: str) -> str:
    """The error for `reference` after the item's label (its position and the reference as given)."""
    with pytest.raises(ImageInputError) as refused:
        validate_images([reference])
    label, _, reason = str(refused.value).partition("'): ")
    assert label.startswith("input 'images' item 1 (") and reason
    return reason


def test_files_outside_the_allowed_folders_look_missing(tmp_path, medical, monkeypatch):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    inside_png, outside_png = root / "sub" / "retina.png", outside / "retina.png"
    inside_png.write_bytes(medical["retina"].read_bytes())
    outside_png.write_bytes(medical["retina"].read_bytes())
    (root / "escape.png").symlink_to(outside_png)  # a link inside the root to a file outside it
    (root / "inner.png").symlink_to(inside_png)  # a link that stays inside
    monkeypatch.setenv(IMAGE_ROOTS_ENV, os.pathsep.join([str(root), str(tmp_path / "elsewhere")]))
    missing = _refusal(str(root / "missing.png"))
    assert "no such file in the allowed image folders" in missing and IMAGE_ROOTS_ENV in missing
    for reference in (
        str(outside_png),
        str(root / "escape.png"),
        str(root / "sub" / ".." / ".." / "outside" / "retina.png"),
        "/etc/passwd",
        "/proc/self/environ",
        "~/.ssh/id_rsa",
        "a\0b",
    ):
        assert _refusal(reference) == missing, reference
    for reference in (str(inside_png), str(root / "inner.png")):
        assert validate_images([reference]) == [reference]
        assert image_data(reference).data == medical["retina"].read_bytes()
    with pytest.raises(ImageInputError, match="no such file in the allowed"):
        image_data(str(outside_png))  # reading for a model checks the roots too, not only validation
    monkeypatch.setenv(IMAGE_ROOTS_ENV, os.sep)  # `/`: every path
    assert validate_images([str(outside_png), str(root / "escape.png")])
    monkeypatch.delenv(IMAGE_ROOTS_ENV)  # the default: the working directory and the temp folder
    assert validate_images([str(outside_png)])
    assert _refusal("/etc/hostname") == missing


def test_trace_records_hash_the_bytes_and_keep_no_pixels(medical):
    png = medical["retina"]
    digest = hashlib.sha256(png.read_bytes()).hexdigest()
    assert image_record(str(png)) == {"ref": str(png), "sha256": digest}
    assert image_record(data_uri(png, "image/png")) == {"ref": f"data:image/png;sha256={digest}", "sha256": digest}
    assert image_record("https://example.org/x.png") == {"ref": "https://example.org/x.png", "sha256": None}
    ct = medical["ct"]  # a DICOM file is hashed as it is on disk, not as the PNG it is sent as
    assert image_record(str(ct))["sha256"] == hashlib.sha256(ct.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------- OpenAI-compatible server


class RecordingServer:
    """A real OpenAI-compatible server on 127.0.0.1 that keeps every request body and answers as the scripted
    MMedAgent panel would (so the whole graph runs against it)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        lock = threading.Lock()
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(min(int(self.headers.get("Content-Length") or 0), MAX_BODY_BYTES)))
                with lock:
                    bodies.append(body)
                payload = json.dumps(_panel_completion(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> RecordingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _panel_completion(body: dict[str, Any]) -> dict[str, Any]:
    from langchain_core.messages import convert_to_messages

    from ermedrag.testing.scripted.panel import reply

    content = reply(convert_to_messages(body["messages"]))
    return {
        "id": "cmpl-images",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "x"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def _image_blocks(body: dict[str, Any]) -> list[str]:
    """The image URLs of the request's last user message (its other messages must carry none)."""
    *earlier, last = [m for m in body["messages"] if m["role"] == "user"]
    assert all(isinstance(m["content"], str) for m in earlier)
    return [block["image_url"]["url"] for block in last["content"] if block["type"] == "image_url"]


def _decoded(url: str) -> bytes:
    assert url.startswith("data:image/") and ";base64," in url
    return base64.b64decode(url.split(",", 1)[1])


def test_openai_request_carries_image_blocks_with_the_files_bytes(medical, monkeypatch):
    monkeypatch.delenv("ERMEDRAG_OPENAI_VISION", raising=False)
    ihc_uri = data_uri(medical["ihc"], "image/jpeg")
    refs = [str(medical["retina"]), str(medical["ct"]), ihc_uri, "https://example.org/chest.png"]
    messages = with_images(
        [
            SystemMessage(content="You are the triage doctor."),
            HumanMessage(content="Question: what is shown? #triage=Radiologist"),
        ],
        refs,
    )
    with RecordingServer() as server:
        model = load_chat_model("openai:vlm", base_url=server.base_url, max_retries=0)
        assert "Radiologist" in model.invoke(messages).text
        (body,) = server.bodies
    user = body["messages"][-1]
    assert [b["type"] for b in user["content"]] == ["image_url"] * 4 + ["text"]
    assert user["content"][-1]["text"].startswith("Question: what is shown?")
    retina, ct, ihc, url = _image_blocks(body)
    assert retina.startswith("data:image/png;base64,") and _decoded(retina) == medical["retina"].read_bytes()
    assert ct.startswith("data:image/png;base64,") and _decoded(ct) == image_data(str(medical["ct"])).data
    assert ihc == ihc_uri and url == "https://example.org/chest.png"  # sent as given
    assert message_images(messages[-1]) == refs  # the caller's messages still hold references, not pixels


def test_openai_model_declared_text_only_refuses_before_sending(medical, monkeypatch):
    monkeypatch.setenv("ERMEDRAG_OPENAI_VISION", "0")
    messages = with_images([HumanMessage(content="What is shown?")], [str(medical["retina"])])
    with RecordingServer() as server:
        model = load_chat_model("openai:text-model", base_url=server.base_url, max_retries=0)
        with pytest.raises(
            ImagesNotSupportedError, match="openai:text-model cannot see images.*ERMEDRAG_OPENAI_VISION"
        ):
            model.invoke(messages)
        assert model.invoke(
            [SystemMessage(content="You are the triage doctor."), HumanMessage(content="no images here")]
        ).text  # text still works
        assert len(server.bodies) == 1


def test_graph_over_a_real_server_shows_every_role_the_images_and_traces_keep_hashes(
    medical, tmp_path, monkeypatch, image_home
):
    monkeypatch.delenv("ERMEDRAG_OPENAI_VISION", raising=False)
    ihc_uri = data_uri(medical["ihc"], "image/jpeg")
    images = [str(medical["retina"]), ihc_uri]
    db = tmp_path / "t.sqlite"
    with RecordingServer() as server:
        ctx = {"respondent_model": "openai:vlm", "base_url": server.base_url, "trace_db": str(db), "max_retries": 0}
        state = graph.invoke(
            {"question": "Which finding? #answers=A,A,B", "options": OPTIONS, "gold": "A", "images": images},
            context=ctx,
        )
        bodies = list(server.bodies)
    assert state["answer"]["answer"] == "A" and state["images"][0] == images[0]
    ihc_digest = hashlib.sha256(medical["ihc"].read_bytes()).hexdigest()
    assert state["images"][1] == str(image_home / "images" / f"{ihc_digest}.jpg")  # the data URI, as a file
    assert len(bodies) == 5  # triage, three specialists, the attending: each one saw both images
    for body in bodies:
        retina, ihc = _image_blocks(body)
        assert _decoded(retina) == medical["retina"].read_bytes() and ihc == ihc_uri
    events = list(TraceStore(db).events(run_id=state["run_id"]))
    assert Counter(e["agent"] for e in events) == {"triage": 1, "specialist": 3, "attending": 1}
    digest = {name: hashlib.sha256(medical[name].read_bytes()).hexdigest() for name in ("retina", "ihc")}
    for event in events:
        assert event["messages"][-1]["images"] == [
            {"ref": str(medical["retina"]), "sha256": digest["retina"]},
            {"ref": f"data:image/jpeg;sha256={digest['ihc']}", "sha256": digest["ihc"]},
        ]
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("t.sqlite*"))  # the database and its WAL
    for name in ("retina", "ihc"):
        assert base64.b64encode(medical[name].read_bytes())[:200] not in stored
    assert b";base64," not in stored


def noise_png(path: Path, side: int = 600) -> Path:
    """A PNG of random pixels: it does not compress, so its data URI is about 1.4 MB."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype="uint8")).save(path)
    return path


def test_a_data_uri_is_written_once_and_only_its_path_reaches_state_tasks_and_checkpoints(tmp_path, image_home):
    from langgraph.checkpoint.memory import InMemorySaver

    png = noise_png(tmp_path / "scan.png")
    uri = data_uri(png, "image/png")
    digest = hashlib.sha256(png.read_bytes()).hexdigest()
    cached = image_home / "images" / f"{digest}.png"
    question = {"question": "Which finding? #answers=A,A,B", "options": OPTIONS, "gold": "A", "images": [uri]}
    db = tmp_path / "t.sqlite"
    saver = InMemorySaver()
    checkpointed = builder.compile(checkpointer=saver)
    thread = {"configurable": {"thread_id": "one"}}
    ctx = {"respondent_model": PANEL + "?vision=1", "trace_db": str(db), "n_specialists": 8}
    state = checkpointed.invoke(question, config=thread, context=ctx)

    assert state["images"] == [str(cached)] and cached.read_bytes() == base64.b64decode(uri.split(",", 1)[1])
    serialised = json.dumps(state, default=str)
    assert ";base64," not in serialised and len(serialised) < 20_000 < len(uri)
    checkpoints = list(saver.list(thread))
    with_base64 = [
        c.metadata["step"] for c in checkpoints if b";base64," in pickle.dumps((c.checkpoint, c.pending_writes))
    ]
    # Only the checkpoints of the input itself (before intake ran: steps -1 and 0); before the cache every one of
    # the run's checkpoints and each specialist's task carried it (23 stored copies here, 3 now).
    assert set(with_base64) <= {-1, 0} and len(checkpoints) > 4
    events = list(TraceStore(db).events(run_id=state["run_id"]))
    assert len(events) == 1 + 8 + 1  # triage, eight specialists, the attending
    for event in events:  # traces keep the original reference form, never the cache path
        assert event["messages"][-1]["images"] == [{"ref": f"data:image/png;sha256={digest}", "sha256": digest}]

    written = cached.stat()
    again = graph.invoke(question, context=ctx)  # a rerun reuses the file
    assert again["images"] == [str(cached)] and cached.stat().st_mtime_ns == written.st_mtime_ns
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no leftover temporary files


# ------------------------------------------------------------------------------------- models that cannot see


def test_text_only_models_refuse_images_through_the_graph_before_loading(medical, tmp_path, monkeypatch):
    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded (or converted) for a model that cannot see")

    monkeypatch.setattr(hf_backend, "load_hf_model", no_loading)
    monkeypatch.setattr("ermedrag.tools.models.offline.offline_model_dir", no_loading)
    db = str(tmp_path / "t.sqlite")
    question = {"question": "What does this CT show?", "options": OPTIONS, "images": [str(medical["ct"])]}
    with pytest.raises(ImagesNotSupportedError) as refused:
        graph.invoke(question, context={"respondent_model": "offline:gemma3-270m", "trace_db": db})
    message = str(refused.value)
    assert "input 'images'" in message and "triage doctor's model offline:gemma3-270m cannot see images" in message
    assert "text-only" in message and "set context field 'respondent_model' to a vision-language model" in message
    with pytest.raises(ImagesNotSupportedError, match="specialist's model offline:gemma3-270m.*'specialist_model'"):
        graph.invoke(
            question,
            context={
                "respondent_model": PANEL + "?vision=1",
                "trace_db": db,
                "specialist_model": "offline:gemma3-270m",
            },
        )
    assert TraceStore(db).runs() == []  # refused before a run was opened


def test_backends_refuse_images_at_call_time_naming_the_model(medical, tmp_path):
    from transformers import LlamaConfig

    messages = with_images([HumanMessage(content="What is shown?")], [str(medical["retina"])])
    with pytest.raises(
        ImagesNotSupportedError, match="scripted:ermedrag.testing.scripted.panel cannot see images.*vision=1"
    ):
        load_chat_model(PANEL).invoke(messages)
    assert (
        "<answer>"
        in load_chat_model(PANEL + "?vision=1")
        .invoke(
            with_images(
                [SystemMessage(content="You are the triage doctor."), HumanMessage(content="q")],
                [str(medical["retina"])],
            )
        )
        .text
    )
    text_model = tmp_path / "text-llm"  # a config and no weights: a refusal must come before any loading
    LlamaConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(text_model)
    with pytest.raises(ImagesNotSupportedError, match=f"hf:{text_model} cannot see images: it is a text-only"):
        HFChatModel(model_path=str(text_model), spec=f"hf:{text_model}").invoke(messages)


# -------------------------------------------------------------------------- a tiny vision-language model (hf)

TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vlm(folder: Path) -> Path:
    """A randomly initialised LLaVA (a 1-layer CLIP vision tower on 32x32 images, a 1-layer Llama) with its
    processor: a byte-level tokenizer built here (any text, no download) and the PIL CLIP image processor."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<bos>", "<image>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = TINY_TEMPLATE
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # 32/8 squared = 16 patches; the CLS token is added by the tower and dropped by the "default" strategy.
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=8,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=TINY_TEMPLATE,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=32,
            patch_size=8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            projection_dim=16,
        ),
        text_config=LlamaConfig(
            vocab_size=len(fast),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16384,
            pad_token_id=fast.pad_token_id,
            eos_token_id=fast.eos_token_id,
            bos_token_id=fast.bos_token_id,
        ),
        image_token_id=fast.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture
def vision_calls(tiny_vlm, monkeypatch):
    """Counts the forward passes of the tiny model's vision tower (each one: an image reached the model)."""
    monkeypatch.setenv("ERMEDRAG_TORCH_THREADS", "1")
    _, model = hf_backend.load_hf_vision_model(str(tiny_vlm), "cpu")
    calls: list[tuple[int, ...]] = []

    def record(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        calls.append(tuple((args[0] if args else kwargs["pixel_values"]).shape))

    handle = model.model.vision_tower.register_forward_hook(record, with_kwargs=True)
    yield calls
    handle.remove()


def test_hf_vision_model_gets_the_pixels_and_the_image_tokens(tiny_vlm, vision_calls, medical):
    model = load_chat_model(f"hf:{tiny_vlm}", max_new_tokens=4)
    messages = with_images(
        [SystemMessage(content="You are a Radiologist."), HumanMessage(content="What is shown?")],
        [str(medical["ct"]), str(medical["retina"])],
    )
    reply = model.invoke(messages)
    seen = reply.response_metadata["vision_inputs"]
    assert seen["images"] == 2 and seen["pixel_values_shape"] == [2, 3, 32, 32]
    assert seen["image_tokens"] == 2 * 16  # 16 patches per image
    assert vision_calls == [(2, 3, 32, 32)]  # the vision tower ran once, on both images
    assert reply.usage_metadata["input_tokens"] == seen["prompt_tokens"] and reply.usage_metadata["output_tokens"] > 0
    assert len(reply.response_metadata["logprobs"]["content"]) == reply.usage_metadata["output_tokens"]
    text_only = model.invoke([HumanMessage(content="No image here.")])  # a VLM answers text through its processor
    assert text_only.response_metadata["vision_inputs"]["image_tokens"] == 0 and len(vision_calls) == 1
    with pytest.raises(ImagesNotSupportedError, match="never URLs"):
        model.invoke(with_images([HumanMessage(content="q")], ["https://example.org/x.png"]))


def test_hf_vision_model_answers_through_the_whole_graph(tiny_vlm, vision_calls, medical, tmp_path):
    db = tmp_path / "t.sqlite"
    budgets = {
        "triage_max_new_tokens": 4,
        "specialist_max_new_tokens": 4,
        "attending_max_new_tokens": 4,
        "n_specialists": 2,
        "answer_extraction": False,
    }
    state = graph.invoke(
        {
            "question": "Which finding does this CT show?",
            "options": OPTIONS,
            "gold": "A",
            "images": [str(medical["ct"])],
        },
        context={"respondent_model": f"hf:{tiny_vlm}", "trace_db": str(db), **budgets},
    )
    events = list(TraceStore(db).events(run_id=state["run_id"]))
    assert Counter(e["agent"] for e in events) == {"triage": 1, "specialist": 2, "attending": 1}
    assert vision_calls == [(1, 3, 32, 32)] * 4  # triage, two specialists, attending: each saw the CT
    ct_hash = hashlib.sha256(medical["ct"].read_bytes()).hexdigest()
    assert all(e["messages"][-1]["images"] == [{"ref": str(medical["ct"]), "sha256": ct_hash}] for e in events)
    assert TraceStore(db).run(state["run_id"])["status"] == "finished"
