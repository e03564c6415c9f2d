#!/usr/bin/env python3
"""Writes the example model repository `models/` and its reference data.

Every ONNX model is built here from fixed seeds (weights are random but always the same),
saved as `models/<name>/1/model.onnx` next to a Triton-style `config.pbtxt`, and run with
onnxruntime on fixed-seed inputs; the inputs and onnxruntime's outputs are written to
`tests/fixtures/models/<name>.json`, which `tests/onnx_models.rs` replays through the
library. Running the script twice gives byte-identical files.

Needs: numpy, onnx, onnxruntime (`pip install numpy onnx onnxruntime`).
Run from anywhere: `python3 models/generate.py`.
"""

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17
PRODUCER = "libinfer models/generate.py"

ROOT = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(ROOT), "tests", "fixtures", "models")

# Triton's names for the element types used here.
TRITON_NAME = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int32): "INT32",
    np.dtype(np.uint8): "UINT8",
}
ONNX_TYPE = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
}

# MNIST's pixel mean and standard deviation, used by `preprocess`.
PIXEL_MEAN = 0.1307
PIXEL_STD = 0.3081

# The smallest gap between the two largest logits accepted for a classification case,
# so that the expected argmax cannot flip between runtimes.
LABEL_MARGIN = 1e-2


# ---------------------------------------------------------------------------------------
# Graph building
# ---------------------------------------------------------------------------------------


def value_info(name, dtype, dims):
    """A graph input or output; a string dim is symbolic (dim_param)."""
    return helper.make_tensor_value_info(name, ONNX_TYPE[np.dtype(dtype)], dims)


def init(name, array):
    return numpy_helper.from_array(np.ascontiguousarray(array), name=name)


def make_model(name, nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    model = helper.make_model(
        graph,
        producer_name=PRODUCER,
        producer_version="1",
        opset_imports=[helper.make_opsetid("", OPSET)],
    )
    model.ir_version = IR_VERSION
    model.model_version = 1
    onnx.checker.check_model(model, full_check=True)
    return model


def dense_weights(rng, fan_in, fan_out):
    """He-initialised weights [fan_out, fan_in] and small biases [fan_out]."""
    w = rng.standard_normal((fan_out, fan_in)) * np.sqrt(2.0 / fan_in)
    b = rng.standard_normal(fan_out) * 0.1
    return w.astype(np.float32), b.astype(np.float32)


def add_sub_model():
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub"),
    ]
    io = lambda n: value_info(n, np.float32, ["batch", 16])
    return make_model(
        "add_sub",
        nodes,
        [io("INPUT0"), io("INPUT1")],
        [io("OUTPUT0"), io("OUTPUT1")],
        [],
    )


def mlp_model():
    rng = np.random.default_rng(1001)
    w1, b1 = dense_weights(rng, 64, 128)
    w2, b2 = dense_weights(rng, 128, 64)
    w3, b3 = dense_weights(rng, 64, 10)
    nodes = [
        # Layer 1 as Gemm (B transposed), layer 2 as MatMul + Add, layer 3 as Gemm.
        helper.make_node("Gemm", ["FEATURES", "w1", "b1"], ["h1"], name="fc1", transB=1),
        helper.make_node("Relu", ["h1"], ["a1"], name="relu1"),
        helper.make_node("MatMul", ["a1", "w2t"], ["m2"], name="fc2_matmul"),
        helper.make_node("Add", ["m2", "b2"], ["h2"], name="fc2_bias"),
        helper.make_node("Relu", ["h2"], ["a2"], name="relu2"),
        helper.make_node("Gemm", ["a2", "w3", "b3"], ["LOGITS"], name="fc3", transB=1),
    ]
    return make_model(
        "mlp",
        nodes,
        [value_info("FEATURES", np.float32, ["batch", 64])],
        [value_info("LOGITS", np.float32, ["batch", 10])],
        [
            init("w1", w1),
            init("b1", b1),
            init("w2t", w2.T),
            init("b2", b2),
            init("w3", w3),
            init("b3", b3),
        ],
    )


def cnn_model():
    rng = np.random.default_rng(1002)
    c1 = (rng.standard_normal((8, 1, 3, 3)) * np.sqrt(2.0 / 9)).astype(np.float32)
    c1b = (rng.standard_normal(8) * 0.1).astype(np.float32)
    c2 = (rng.standard_normal((16, 8, 3, 3)) * np.sqrt(2.0 / 72)).astype(np.float32)
    c2b = (rng.standard_normal(16) * 0.1).astype(np.float32)
    fw, fb = dense_weights(rng, 16 * 7 * 7, 10)
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])
    nodes = [
        helper.make_node("Conv", ["PIXELS", "c1", "c1b"], ["x1"], name="conv1", **conv),
        helper.make_node("Relu", ["x1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", **pool),  # 14x14
        helper.make_node("Conv", ["p1", "c2", "c2b"], ["x2"], name="conv2", **conv),
        helper.make_node("Relu", ["x2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool2", **pool),  # 7x7
        helper.make_node("Flatten", ["p2"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fw", "fb"], ["LOGITS"], name="fc", transB=1),
    ]
    return make_model(
        "cnn",
        nodes,
        [value_info("PIXELS", np.float32, ["batch", 1, 28, 28])],
        [value_info("LOGITS", np.float32, ["batch", 10])],
        [init("c1", c1), init("c1b", c1b), init("c2", c2), init("c2b", c2b), init("fw", fw), init("fb", fb)],
    )


def accumulator_model():
    # OUTPUT = INPUT + INPUT_STATE * (1 - START): a running sum that also restarts on
    # its own when the START control is 1 (the library resets the state to zeros on
    # START as well). OUTPUT_STATE = OUTPUT.
    nodes = [
        helper.make_node("Cast", ["START"], ["start_f"], name="start_to_float", to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "start_f"], ["keep"], name="keep"),
        helper.make_node("Mul", ["INPUT_STATE", "keep"], ["carried"], name="carry"),
        helper.make_node("Add", ["INPUT", "carried"], ["OUTPUT"], name="accumulate"),
        helper.make_node("Identity", ["OUTPUT"], ["OUTPUT_STATE"], name="next_state"),
    ]
    return make_model(
        "accumulator_onnx",
        nodes,
        [
            value_info("INPUT", np.float32, ["batch", 1]),
            value_info("INPUT_STATE", np.float32, ["batch", 1]),
            value_info("START", np.int32, ["batch", 1]),
        ],
        [
            value_info("OUTPUT", np.float32, ["batch", 1]),
            value_info("OUTPUT_STATE", np.float32, ["batch", 1]),
        ],
        [init("one", np.array(1.0, dtype=np.float32))],
    )


def preprocess_model():
    nodes = [
        helper.make_node("Cast", ["IMAGE"], ["f"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Div", ["f", "scale"], ["unit"], name="to_unit_range"),
        helper.make_node("Sub", ["unit", "mean"], ["centred"], name="centre"),
        helper.make_node("Div", ["centred", "std"], ["normed"], name="normalise"),
        helper.make_node("Unsqueeze", ["normed", "channel_axis"], ["PIXELS"], name="add_channel"),
    ]
    return make_model(
        "preprocess",
        nodes,
        [value_info("IMAGE", np.uint8, ["batch", 28, 28])],
        [value_info("PIXELS", np.float32, ["batch", 1, 28, 28])],
        [
            init("scale", np.array(255.0, dtype=np.float32)),
            init("mean", np.array(PIXEL_MEAN, dtype=np.float32)),
            init("std", np.array(PIXEL_STD, dtype=np.float32)),
            init("channel_axis", np.array([1], dtype=np.int64)),
        ],
    )


def postprocess_model():
    nodes = [
        helper.make_node("Softmax", ["LOGITS"], ["PROBABILITIES"], name="softmax", axis=-1),
        helper.make_node("ArgMax", ["LOGITS"], ["LABEL"], name="argmax", axis=1, keepdims=1),
    ]
    return make_model(
        "postprocess",
        nodes,
        [value_info("LOGITS", np.float32, ["batch", 10])],
        [
            value_info("PROBABILITIES", np.float32, ["batch", 10]),
            value_info("LABEL", np.int64, ["batch", 1]),
        ],
        [],
    )


# ---------------------------------------------------------------------------------------
# Configs (Triton's config.pbtxt)
# ---------------------------------------------------------------------------------------


def tensor_entries(tensors):
    return ",\n".join(
        f'  {{ name: "{n}" data_type: TYPE_{TRITON_NAME[np.dtype(dt)]} dims: [ {", ".join(str(d) for d in dims)} ] }}'
        for n, dt, dims in tensors
    )


def onnx_config(name, max_batch_size, inputs, outputs, extra=""):
    text = f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
    text += f"input [\n{tensor_entries(inputs)}\n]\n"
    text += f"output [\n{tensor_entries(outputs)}\n]\n"
    return text + extra


CONFIGS = {
    "add_sub": onnx_config(
        "add_sub",
        8,
        [("INPUT0", np.float32, [16]), ("INPUT1", np.float32, [16])],
        [("OUTPUT0", np.float32, [16]), ("OUTPUT1", np.float32, [16])],
    ),
    "mlp": onnx_config(
        "mlp",
        64,
        [("FEATURES", np.float32, [64])],
        [("LOGITS", np.float32, [10])],
        "dynamic_batching {\n  max_queue_delay_microseconds: 2000\n}\n"
        "instance_group [ { count: 1 kind: KIND_AUTO } ]\n",
    ),
    # No max_batch_size, input or output: the backend completes them from the model
    # (max_batch_size 4 because every input and output has a symbolic first dim).
    "cnn": '# Inputs, outputs and max_batch_size are completed from model.onnx at load.\n'
    'name: "cnn"\nplatform: "onnxruntime_onnx"\n',
    "accumulator_onnx": onnx_config(
        "accumulator_onnx",
        4,
        [("INPUT", np.float32, [1])],
        [("OUTPUT", np.float32, [1])],
        """sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }
  ]
  state [
    { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] }
  ]
}
instance_group [ { count: 1 kind: KIND_AUTO } ]
""",
    ),
    "preprocess": onnx_config(
        "preprocess",
        8,
        [("IMAGE", np.uint8, [28, 28])],
        [("PIXELS", np.float32, [1, 28, 28])],
        "dynamic_batching { }\n",
    ),
    "postprocess": onnx_config(
        "postprocess",
        8,
        [("LOGITS", np.float32, [10])],
        [("PROBABILITIES", np.float32, [10]), ("LABEL", np.int64, [1])],
        "dynamic_batching { }\n",
    ),
    "image_classifier": """name: "image_classifier"
platform: "ensemble"
max_batch_size: 4
input [
  { name: "IMAGE" data_type: TYPE_UINT8 dims: [ 28, 28 ] }
]
output [
  { name: "PROBABILITIES" data_type: TYPE_FP32 dims: [ 10 ] },
  { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "IMAGE" value: "IMAGE" }
      output_map { key: "PIXELS" value: "pixels" }
    },
    {
      model_name: "cnn"
      model_version: -1
      input_map { key: "PIXELS" value: "pixels" }
      output_map { key: "LOGITS" value: "logits" }
    },
    {
      model_name: "postprocess"
      model_version: -1
      input_map { key: "LOGITS" value: "logits" }
      output_map { key: "PROBABILITIES" value: "PROBABILITIES" }
      output_map { key: "LABEL" value: "LABEL" }
    }
  ]
}
""",
}


# ---------------------------------------------------------------------------------------
# Reference data
# ---------------------------------------------------------------------------------------


def session(model):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def tensor_json(name, array):
    array = np.asarray(array)
    kind = array.dtype.kind
    data = [float(v) for v in array.ravel()] if kind == "f" else [int(v) for v in array.ravel()]
    return {
        "name": name,
        "datatype": TRITON_NAME[array.dtype],
        "shape": [int(d) for d in array.shape],
        "data": data,
    }


def case_json(inputs, outputs):
    return {
        "inputs": [tensor_json(n, a) for n, a in inputs.items()],
        "outputs": [tensor_json(n, a) for n, a in outputs.items()],
    }


def run_cases(sess, input_sets):
    """One case per dict of inputs, with onnxruntime's outputs."""
    names = [o.name for o in sess.get_outputs()]
    cases = []
    for inputs in input_sets:
        outs = sess.run(names, inputs)
        cases.append(case_json(inputs, dict(zip(names, outs))))
    return cases


def top_margin(logits):
    """The smallest gap between the largest and second largest value of each row."""
    s = np.sort(logits, axis=-1)
    return float(np.min(s[..., -1] - s[..., -2]))


def images(rng, n):
    """`n` 28x28 uint8 images: noise plus a bright random rectangle (some structure, so
    the CNN's logits vary from image to image)."""
    out = rng.integers(0, 64, size=(n, 28, 28)).astype(np.uint8)
    for img in out:
        r0, c0 = rng.integers(2, 16, size=2)
        h, w = rng.integers(4, 12, size=2)
        img[r0 : r0 + h, c0 : c0 + w] = rng.integers(160, 256, size=(h, w))
    return out


def classification_images(rng, n, pipeline):
    """Draws images until `n` have a clear winning class through `pipeline` (logits)."""
    kept = []
    while len(kept) < n:
        img = images(rng, 1)
        if top_margin(pipeline(img)) >= LABEL_MARGIN:
            kept.append(img)
    return np.concatenate(kept)


def reference_data(models):
    sess = {name: session(m) for name, m in models.items()}
    refs = {}

    rng = np.random.default_rng(2001)
    refs["add_sub"] = run_cases(
        sess["add_sub"],
        [
            {
                "INPUT0": rng.standard_normal((b, 16)).astype(np.float32),
                "INPUT1": rng.standard_normal((b, 16)).astype(np.float32),
            }
            for b in (1, 3, 8)
        ],
    )

    rng = np.random.default_rng(2002)
    refs["mlp"] = run_cases(
        sess["mlp"],
        [{"FEATURES": rng.standard_normal((b, 64)).astype(np.float32)} for b in (1, 3, 64)],
    )

    def pre(img):
        return sess["preprocess"].run(["PIXELS"], {"IMAGE": img})[0]

    def cnn(pixels):
        return sess["cnn"].run(["LOGITS"], {"PIXELS": pixels})[0]

    def post(logits):
        return sess["postprocess"].run(["PROBABILITIES", "LABEL"], {"LOGITS": logits})

    rng = np.random.default_rng(2003)
    pixels = [pre(images(rng, b)) for b in (1, 3, 4)]
    refs["cnn"] = run_cases(sess["cnn"], [{"PIXELS": p} for p in pixels])

    rng = np.random.default_rng(2004)
    refs["preprocess"] = run_cases(sess["preprocess"], [{"IMAGE": images(rng, b)} for b in (1, 3)])

    rng = np.random.default_rng(2005)
    logit_sets = []
    for b in (1, 3, 8):
        while True:
            logits = (rng.standard_normal((b, 10)) * 3).astype(np.float32)
            if top_margin(logits) >= LABEL_MARGIN:
                break
        logit_sets.append({"LOGITS": logits})
    refs["postprocess"] = run_cases(sess["postprocess"], logit_sets)

    # The ensemble: preprocess -> cnn -> postprocess, chained through onnxruntime.
    rng = np.random.default_rng(2006)
    cases = []
    for b in (1, 3, 4):
        img = classification_images(rng, b, lambda i: cnn(pre(i)))
        probs, label = post(cnn(pre(img)))
        cases.append(case_json({"IMAGE": img}, {"PROBABILITIES": probs, "LABEL": label}))
    refs["image_classifier"] = cases

    refs["accumulator_onnx"] = accumulator_reference(sess["accumulator_onnx"])
    return refs


def accumulator_reference(sess):
    """Sequences of one-value requests with the running sums, computed one request at a
    time with onnxruntime, feeding each request the previous output state (zeros on
    START). Two sequences, then the first correlation ID starting again."""
    rng = np.random.default_rng(2007)
    plan = [(1001, 7), (1002, 5), (1001, 4)]
    sequences = []
    for corrid, length in plan:
        values = np.round(rng.uniform(-10, 10, size=length), 3).astype(np.float32)
        state = np.zeros((1, 1), dtype=np.float32)
        steps = []
        for k, v in enumerate(values):
            start = k == 0
            x = np.array([[v]], dtype=np.float32)
            if start:
                state = np.zeros((1, 1), dtype=np.float32)
            out, state = sess.run(
                ["OUTPUT", "OUTPUT_STATE"],
                {"INPUT": x, "INPUT_STATE": state, "START": np.array([[int(start)]], dtype=np.int32)},
            )
            expected = np.float32(np.sum(values[: k + 1], dtype=np.float32))
            assert abs(float(out[0, 0]) - float(expected)) <= 1e-3, (out, expected)
            step = case_json({"INPUT": x}, {"OUTPUT": out})
            step["start"] = start
            step["end"] = k == length - 1
            steps.append(step)
        sequences.append({"correlation_id": corrid, "steps": steps})
    return sequences


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


def compact(value):
    return json.dumps(value, separators=(", ", ": "))


def fixture_text(name, key, items):
    """JSON with one line per tensor (the data on that line), so the file stays readable."""

    def case_lines(case, indent):
        pad = " " * indent
        lines = [pad + "{"]
        extras = [k for k in case if k not in ("inputs", "outputs")]
        for k in extras:
            lines.append(f"{pad}  {json.dumps(k)}: {compact(case[k])},")
        for part in ("inputs", "outputs"):
            lines.append(f'{pad}  "{part}": [')
            tensors = case[part]
            for i, t in enumerate(tensors):
                lines.append(f"{pad}    {compact(t)}" + ("," if i + 1 < len(tensors) else ""))
            lines.append(f"{pad}  ]" + ("," if part == "inputs" else ""))
        lines.append(pad + "}")
        return lines

    out = ["{", f'  "model": {json.dumps(name)},', '  "reference": "onnxruntime",', f'  "{key}": [']
    for i, item in enumerate(items):
        comma = "," if i + 1 < len(items) else ""
        if key == "sequences":
            out.append("    {")
            out.append(f'      "correlation_id": {item["correlation_id"]},')
            out.append('      "steps": [')
            for j, step in enumerate(item["steps"]):
                lines = case_lines(step, 8)
                if j + 1 < len(item["steps"]):
                    lines[-1] += ","
                out.extend(lines)
            out.append("      ]")
            out.append("    }" + comma)
        else:
            lines = case_lines(item, 4)
            lines[-1] += comma
            out.extend(lines)
    out += ["  ]", "}"]
    return "\n".join(out) + "\n"


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode) as f:
        f.write(data)


def main():
    models = {
        "add_sub": add_sub_model(),
        "mlp": mlp_model(),
        "cnn": cnn_model(),
        "accumulator_onnx": accumulator_model(),
        "preprocess": preprocess_model(),
        "postprocess": postprocess_model(),
    }
    for name, model in models.items():
        write(os.path.join(ROOT, name, "1", "model.onnx"), model.SerializeToString(deterministic=True))
    for name, text in CONFIGS.items():
        write(os.path.join(ROOT, name, "config.pbtxt"), text)
    # The ensemble has no files of its own; an empty version folder (kept in git by a
    # placeholder) gives it Triton's layout.
    write(os.path.join(ROOT, "image_classifier", "1", ".gitkeep"), "")

    refs = reference_data(models)
    for name, items in refs.items():
        key = "sequences" if name == "accumulator_onnx" else "cases"
        write(os.path.join(FIXTURES, name + ".json"), fixture_text(name, key, items))

    total = 0
    for base in (ROOT, FIXTURES):
        for dirpath, _, files in os.walk(base):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    print(f"wrote {len(CONFIGS)} models and {len(refs)} fixtures ({total / 1e6:.2f} MB in all)", file=sys.stderr)


if __name__ == "__main__":
    main()
