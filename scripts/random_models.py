#!/usr/bin/env python3
"""Random-weight models for scripts/gpu-check.sh, built offline, with their references.

Usage: random_models.py OUT [--small]

Writes Triton model folders as scripts/packaged_models.py does (OUT/<model>/config.pbtxt,
1/model.onnx, cases.json with inputs and reference outputs; see that script for the
format), for tests/onnx_packaged.rs to run on a KIND_GPU instance. numpy and onnx must be
importable, and onnxruntime for the two networks. Weights and inputs come from a fixed
seed; nothing is downloaded.

* `resnet50`: ResNet-50's shape (7x7 stem, max pool, bottleneck blocks 3-4-6-3 of widths
  64-512 expanding 4x, BatchNormalization after every convolution, global average pool, a
  1000-way Gemm), input [N, 3, 224, 224]. References: onnxruntime on the CPU. Cases of
  batch 1 and 4.
* `bert_base`: a BERT-base-shaped encoder (vocabulary 30522, 12 layers, hidden 768, 12
  heads, FFN 3072 with erf GELU, LayerNormalization), written as the exporters write it
  (MatMul, Reshape, Transpose, Softmax, the additive attention mask), inputs input_ids
  and attention_mask INT64 [N, 128], output last_hidden_state. References: onnxruntime on
  the CPU. Cases of batch 1 and 3, the second with padding masked out.
* `gemm_fp32`, `gemm_tf32`, `gemm_fp16`, `gemm_bf16`: y = x W + b, x [M, 1024] and W
  [1024, 1024], under the GPU executor's precisions (no parameter; `allow_tf32`;
  `precision` FP16; `precision` BF16). The reference is computed in float64, and the
  tolerance is the error bound of the precision, stated over S = |x| |W| + |b| (elementwise
  absolute values) with u the unit roundoff of the inputs' format and FP32 accumulation:
    FP32: (K + 2) 2^-24 S
    TF32: (2 u + (K + 2) 2^-24) S, u = 2^-10 (TF32 keeps 10 mantissa bits; the bound
          allows truncation as well as rounding)
    FP16: (5 u + (K + 2) 2^-24) S, u = 2^-11 (x and W rounded, the product and the bias
          sum rounded to FP16 again)
    BF16: as FP16 with u = 2^-8
  The largest error must also be at least a tenth of what rounding x and W alone to the
  format gives ("min_error"): a precision that was asked for and not applied fails.

--small writes the same kinds at a fraction of the size (for the stand-in CUDA libraries,
which run kernels on the host): ResNet widths 16-128, one block per stage, 32x32 inputs,
10 classes; BERT 2 layers, hidden 64, 4 heads, FFN 128, vocabulary 1000, 16 tokens.
"""
import json
import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SEED = 20261126
OPSET = 17


def tensor_entry(folder, file, name, x):
    x = np.asarray(x, order="C")
    datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}[x.dtype]
    x.astype(x.dtype.newbyteorder("<"), copy=False).tofile(os.path.join(folder, file))
    return {"name": name, "datatype": datatype, "shape": list(x.shape), "file": file}


class Graph:
    """Nodes and initializers, with unique names."""

    def __init__(self, rng):
        self.rng, self.nodes, self.inits, self.n = rng, [], [], 0

    def name(self, what):
        self.n += 1
        return f"{what}_{self.n}"

    def init(self, what, value):
        name = self.name(what)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type, inputs, what=None, **attrs):
        out = self.name(what or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def model(self, inputs, outputs):
        g = helper.make_graph(self.nodes, "g", inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def resnet(rng, small):
    g = Graph(rng)
    f32 = np.float32

    def conv_bn(x, cin, cout, k, stride, relu=True, last=False):
        w = rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))
        y = g.op("Conv", [x, g.init("w", w.astype(f32))], kernel_shape=[k, k],
                 strides=[stride, stride], pads=[k // 2] * 4)
        # The last BatchNormalization of a block scales its branch down, as ResNets are
        # trained to, so that 16 residual sums keep activations of order one.
        gamma = rng.uniform(0.05, 0.2, cout) if last else rng.uniform(0.5, 1.0, cout)
        y = g.op("BatchNormalization", [y, g.init("gamma", gamma.astype(f32)),
                                        g.init("beta", (rng.standard_normal(cout) * 0.05).astype(f32)),
                                        g.init("mean", (rng.standard_normal(cout) * 0.05).astype(f32)),
                                        g.init("var", rng.uniform(0.5, 1.5, cout).astype(f32))],
                 epsilon=1e-5)
        return g.op("Relu", [y]) if relu else y

    base, blocks, size, classes = (16, [1, 1, 1, 1], 32, 10) if small else (64, [3, 4, 6, 3], 224, 1000)
    x = conv_bn("input", 3, base, 7, 2)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = base
    for stage, n in enumerate(blocks):
        width = base * 2**stage
        for b in range(n):
            stride = 2 if stage > 0 and b == 0 else 1
            y = conv_bn(x, cin, width, 1, 1)
            y = conv_bn(y, width, width, 3, stride)
            y = conv_bn(y, width, width * 4, 1, 1, relu=False, last=True)
            skip = x if cin == width * 4 and stride == 1 else conv_bn(x, cin, width * 4, 1, stride, relu=False)
            x = g.op("Relu", [g.op("Add", [y, skip])])
            cin = width * 4
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    fc = (rng.standard_normal((classes, cin)) / np.sqrt(cin)).astype(f32)
    logits = g.op("Gemm", [x, g.init("fc_w", fc), g.init("fc_b", np.zeros(classes, f32))], transB=1)
    g.nodes[-1].output[0] = "logits"
    model = g.model(
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])])
    del logits
    cases = [{"input": rng.standard_normal((b, 3, size, size)).astype(f32)} for b in (1, 4)]
    return model, cases


def bert(rng, small):
    g = Graph(rng)
    f32 = np.float32
    vocab, layers, hidden, heads, ffn, seq = (1000, 2, 64, 4, 128, 16) if small else (30522, 12, 768, 12, 3072, 128)
    dh = hidden // heads

    def w(*shape):
        return g.init("w", (rng.standard_normal(shape) * 0.02).astype(f32))

    def b(n):
        return g.init("b", (rng.standard_normal(n) * 0.02).astype(f32))

    def layer_norm(x):
        return g.op("LayerNormalization", [x, g.init("ln_g", rng.uniform(0.8, 1.2, hidden).astype(f32)), b(hidden)],
                    axis=-1, epsilon=1e-12)

    def linear(x, cin, cout):
        return g.op("Add", [g.op("MatMul", [x, w(cin, cout)]), b(cout)])

    x = g.op("Gather", [w(vocab, hidden), "input_ids"], axis=0)
    x = layer_norm(g.op("Add", [x, w(seq, hidden)]))
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask = g.op("Mul", [g.op("Sub", [g.init("one", np.array(1, f32)), mask]), g.init("neg", np.array(-10000, f32))])
    mask = g.op("Unsqueeze", [mask, g.init("axes", np.array([1, 2], np.int64))])
    split = g.init("split_shape", np.array([0, 0, heads, dh], np.int64))
    merge = g.init("merge_shape", np.array([0, 0, hidden], np.int64))
    scale = g.init("scale", np.array(1 / np.sqrt(dh), f32))
    for _ in range(layers):
        q = g.op("Transpose", [g.op("Reshape", [linear(x, hidden, hidden), split])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [linear(x, hidden, hidden), split])], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [linear(x, hidden, hidden), split])], perm=[0, 2, 1, 3])
        s = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), mask])
        a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v])
        a = g.op("Reshape", [g.op("Transpose", [a], perm=[0, 2, 1, 3]), merge])
        x = layer_norm(g.op("Add", [linear(a, hidden, hidden), x]))
        h = linear(x, hidden, ffn)
        gelu = g.op("Erf", [g.op("Div", [h, g.init("sqrt2", np.array(np.sqrt(2), f32))])])
        gelu = g.op("Mul", [g.op("Mul", [h, g.init("half", np.array(0.5, f32))]),
                            g.op("Add", [gelu, g.init("one", np.array(1, f32))])])
        x = layer_norm(g.op("Add", [linear(gelu, ffn, hidden), x]))
    g.nodes[-1].output[0] = "last_hidden_state"
    model = g.model(
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", seq]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", seq])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["N", seq, hidden])])
    ids1 = rng.integers(0, vocab, (1, seq))
    ids3 = rng.integers(0, vocab, (3, seq))
    mask3 = np.ones((3, seq), np.int64)
    mask3[1, seq // 2:] = 0
    mask3[2, seq - 3:] = 0
    cases = [{"input_ids": ids1, "attention_mask": np.ones((1, seq), np.int64)},
             {"input_ids": ids3, "attention_mask": mask3}]
    return model, cases


def write(out, name, model, config, cases, outputs=None, extra=None):
    """One model folder: cases' outputs from `outputs(feeds)`, else onnxruntime's."""
    folder = os.path.join(out, name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "1"))
    onnx.save(model, os.path.join(folder, "1", "model.onnx"))
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\nplatform: "onnxruntime_onnx"\n{config}')
    doc = dict(extra or {})
    if outputs is None:
        import onnxruntime as ort
        session = ort.InferenceSession(os.path.join(folder, "1", "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        outputs = lambda feeds: dict(zip(names, session.run(names, feeds)))  # noqa: E731
        doc["onnxruntime"] = ort.__version__
    doc["cases"] = []
    for k, feeds in enumerate(cases):
        case = {"inputs": [tensor_entry(folder, f"case{k}_in_{n}.bin", n, x) for n, x in feeds.items()],
                "outputs": [tensor_entry(folder, f"case{k}_out_{n}.bin", n, y)
                            for n, y in outputs(feeds).items()]}
        doc["cases"].append(case)
    with open(os.path.join(folder, "cases.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def round_mantissa(x, bits):
    """x (float32) rounded to nearest even with `bits` explicit mantissa bits."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    half = np.uint64(1 << (drop - 1))
    lsb = (u >> np.uint64(drop)) & np.uint64(1)
    u = ((u + half - np.uint64(1) + lsb) >> np.uint64(drop)) << np.uint64(drop)
    return u.astype(np.uint32).view(np.float32)


def gemms(rng, out):
    k, n = 1024, 1024
    f32 = np.float32
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(f32)
    bias = (rng.standard_normal(n) * 0.1).astype(f32)
    g = Graph(rng)
    y = g.op("Add", [g.op("MatMul", ["x", g.init("w", w)]), g.init("b", bias)])
    g.nodes[-1].output[0] = "y"
    del y
    model = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])])
    cases = [{"x": rng.standard_normal((m, k)).astype(f32)} for m in (64, 33)]
    exact = {id(c): c["x"].astype(np.float64) @ w.astype(np.float64) + bias for c in cases}
    bound = max(float((np.abs(c["x"].astype(np.float64)) @ np.abs(w.astype(np.float64)) + np.abs(bias)).max())
                for c in cases)
    acc = (k + 2) * 2.0**-24
    precisions = {
        "fp32": ("", acc, None),
        "tf32": ('parameters { key: "allow_tf32" value: { string_value: "true" } }\n', 2 * 2.0**-10 + acc, 10),
        "fp16": ('parameters { key: "precision" value: { string_value: "FP16" } }\n', 5 * 2.0**-11 + acc, "fp16"),
        "bf16": ('parameters { key: "precision" value: { string_value: "BF16" } }\n', 5 * 2.0**-8 + acc, 7),
    }
    for name, (params, rel, fmt) in precisions.items():
        extra = {"reference": "numpy float64",
                 "tolerance": {"atol": rel * bound, "rtol": 0.0}}
        if fmt is not None:
            def rounded(a):
                return a.astype(np.float16).astype(f32) if fmt == "fp16" else round_mantissa(a, fmt)
            lossy = max(float(np.abs(rounded(c["x"]).astype(np.float64) @ rounded(w).astype(np.float64)
                                     + bias - exact[id(c)]).max()) for c in cases)
            extra["min_error"] = lossy / 10
        write(out, f"gemm_{name}", model, "max_batch_size: 64\n" + params, cases,
              outputs=lambda feeds: {"y": exact[id(next(c for c in cases if c["x"] is feeds["x"]))].astype(f32)},
              extra=extra)
        print(f"gemm_{name}: tolerance {rel * bound:.3g} (bound over S = {bound:.3g})"
              + (f", min_error {extra['min_error']:.3g}" if "min_error" in extra else ""))


def main():
    args = [a for a in sys.argv[1:] if a != "--small"]
    if len(args) != 1:
        sys.exit(__doc__)
    out, small = args[0], "--small" in sys.argv[1:]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    gemms(rng, out)
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        print("random_models.py: no onnxruntime here; resnet50 and bert_base are left out")
        return
    for name, build in (("resnet50", resnet), ("bert_base", bert)):
        model, cases = build(rng, small)
        doc = write(out, name, model, "", cases)
        print(f"{name}{' (small)' if small else ''}: {len(doc['cases'])} cases, references from onnxruntime {doc['onnxruntime']}")


if __name__ == "__main__":
    main()
