#!/usr/bin/env python3
"""Prepares ONNX's node backend test cases for tests/onnx_conformance.rs.

usage: onnx_conformance.py OUT_DIR [--force] [--explicit-config]

Finds the node test cases of the installed `onnx` package
(onnx/backend/test/data/node/<case>/model.onnx with test_data_set_0/input_*.pb and
output_*.pb; when a wheel ships without them, they are generated from the package's own
case definitions) and writes, for each case, a model folder that libinfer loads as it is:

    OUT_DIR/index.json                 onnx version, where the cases came from, every case
                                       with "skipped": reason when it cannot be run
    OUT_DIR/<case>/config.pbtxt        name + platform only: the backend's auto-complete
                                       fills in inputs, outputs and max_batch_size (with
                                       --explicit-config: max_batch_size 0 and every input
                                       and output with its datatype and dims, -1 where the
                                       graph gives no positive size; for telling
                                       auto-complete problems from execution problems)
    OUT_DIR/<case>/1/model.onnx
    OUT_DIR/<case>/data.json           {"inputs": [...], "outputs": [...]}, each
                                       {"name", "datatype" (Triton name), "shape", "file"}
    OUT_DIR/<case>/data/*.bin          raw little-endian tensor bytes (BYTES in Triton's
                                       layout: u32 length + bytes per element)

Only graph inputs that are not initializers are listed. Cases whose inputs or outputs
libinfer cannot carry (sequences, maps, optionals, sparse tensors, complex, 8-, 4- and
2-bit types) are listed in index.json as skipped with the reason. Running it again with
the same onnx version, script and options leaves OUT_DIR as it is.

The configs give only name and platform so that the backend's auto-complete makes them,
as a user of Triton's onnxruntime backend would rely on. Writing `max_batch_size: 0` as
well would change nothing: a proto3 field cannot tell 0 from absent, so auto-complete
may still turn batching on (only when every input and output has a symbolic first dim;
the node cases' tensors have fixed shapes, so it never does here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import sys

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

# ONNX element types that libinfer carries, by their Triton names.
TRITON_TYPES = {
    TensorProto.BOOL: "BOOL",
    TensorProto.UINT8: "UINT8",
    TensorProto.UINT16: "UINT16",
    TensorProto.UINT32: "UINT32",
    TensorProto.UINT64: "UINT64",
    TensorProto.INT8: "INT8",
    TensorProto.INT16: "INT16",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.FLOAT16: "FP16",
    TensorProto.FLOAT: "FP32",
    TensorProto.DOUBLE: "FP64",
    TensorProto.STRING: "BYTES",
    TensorProto.BFLOAT16: "BF16",
}

# Bytes per element of each Triton type (BYTES has none).
TYPE_SIZES = {
    "BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1,
    "INT16": 2, "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2,
}


class Skip(Exception):
    """A case libinfer cannot carry; the message is the reason."""


def elem_type_name(t: int) -> str:
    try:
        return TensorProto.DataType.Name(t)
    except ValueError:
        return f"element type {t}"


def value_kind(vi: onnx.ValueInfoProto) -> str:
    """The Triton datatype of a graph input/output, or raises Skip."""
    which = vi.type.WhichOneof("value")
    if which != "tensor_type":
        kind = (which or "untyped value").replace("_type", "")
        raise Skip(f"'{vi.name}' is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a tensor")
    t = vi.type.tensor_type.elem_type
    if t not in TRITON_TYPES:
        raise Skip(f"'{vi.name}' has datatype {elem_type_name(t)}, which has no Triton datatype")
    return TRITON_TYPES[t]


def to_bytes(name: str, value, datatype: str) -> tuple[list[int], bytes]:
    """(shape, raw little-endian bytes) of a test tensor given as a TensorProto or array."""
    if isinstance(value, TensorProto):
        if value.data_type not in TRITON_TYPES:
            raise Skip(f"'{name}' data has datatype {elem_type_name(value.data_type)}")
        arr = numpy_helper.to_array(value)
    elif isinstance(value, np.ndarray) or np.isscalar(value):
        arr = np.asarray(value)
    else:
        raise Skip(f"'{name}' data is a {type(value).__name__}, not a tensor")
    shape = [int(d) for d in arr.shape]
    if datatype == "BYTES":
        out = bytearray()
        for v in arr.reshape(-1):
            b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
            out += struct.pack("<I", len(b)) + b
        return shape, bytes(out)
    size = TYPE_SIZES[datatype]
    if arr.dtype.itemsize != size:
        raise Skip(f"'{name}' data is {arr.dtype}, expected {datatype}")
    if datatype == "BOOL":
        arr = arr.astype(np.uint8)
    elif arr.dtype.byteorder == ">":
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return shape, np.ascontiguousarray(arr).tobytes()


class PbFile:
    """A shipped .pb file, parsed only once its graph value is known to be a tensor."""

    def __init__(self, path: str):
        self.path = path


def read_pb(path: str) -> TensorProto:
    t = TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return t


def shipped_cases(node_dir: str):
    """(name, model bytes, inputs, outputs) of the cases shipped in the package."""
    for name in sorted(os.listdir(node_dir)):
        case_dir = os.path.join(node_dir, name)
        model_path = os.path.join(case_dir, "model.onnx")
        if not os.path.isfile(model_path):
            continue
        data_dir = os.path.join(case_dir, "test_data_set_0")

        def load(prefix: str):
            files = []
            i = 0
            while os.path.isfile(os.path.join(data_dir, f"{prefix}_{i}.pb")):
                files.append(PbFile(os.path.join(data_dir, f"{prefix}_{i}.pb")))
                i += 1
            return files

        with open(model_path, "rb") as f:
            model_bytes = f.read()
        yield name, model_bytes, load("input"), load("output")


def generated_cases():
    """The same from the package's case definitions (wheels without data/node)."""
    import warnings

    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collected = node_cases.collect_testcases()
    for case in sorted(collected, key=lambda c: c.name):
        if not case.data_sets:
            continue
        inputs, outputs = case.data_sets[0]
        yield case.name, case.model.SerializeToString(), list(inputs), list(outputs)


def explicit_config(name: str, graph: onnx.GraphProto, initializers: set[str]) -> str:
    """A complete config: every tensor with datatype and dims, no batching."""

    def tensor(vi: onnx.ValueInfoProto) -> str:
        shape = vi.type.tensor_type.shape
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in shape.dim]
        if not vi.type.tensor_type.HasField("shape"):
            dims = [-1]
        datatype = "TYPE_STRING" if value_kind(vi) == "BYTES" else "TYPE_" + value_kind(vi)
        return f'{{ name: "{vi.name}" data_type: {datatype} dims: [ {", ".join(map(str, dims))} ] }}'

    ins = [tensor(vi) for vi in graph.input if vi.name not in initializers]
    outs = [tensor(vi) for vi in graph.output]
    return (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        f"input [ {', '.join(ins)} ]\noutput [ {', '.join(outs)} ]\n"
    )


def prepare_case(out_dir: str, name: str, model_bytes: bytes, inputs, outputs, explicit: bool) -> dict:
    """Writes one case's folder; returns its index entry."""
    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    if len(inputs) != len(graph.input) or len(outputs) != len(graph.output):
        raise Skip(
            f"{len(inputs)} input and {len(outputs)} output data files for "
            f"{len(graph.input)} graph inputs and {len(graph.output)} graph outputs"
        )
    tensors = {"inputs": [], "outputs": []}
    blobs = []
    for kind, infos, values in (("inputs", graph.input, inputs), ("outputs", graph.output, outputs)):
        for i, (vi, value) in enumerate(zip(infos, values)):
            if kind == "inputs" and vi.name in initializers:
                continue
            datatype = value_kind(vi)
            if isinstance(value, PbFile):
                value = read_pb(value.path)
            shape, raw = to_bytes(vi.name, value, datatype)
            file = f"data/{kind[:-1]}_{i}.bin"
            tensors[kind].append({"name": vi.name, "datatype": datatype, "shape": shape, "file": file})
            blobs.append((file, raw))
    if not tensors["outputs"]:
        raise Skip("no outputs")
    case_dir = os.path.join(out_dir, name)
    os.makedirs(os.path.join(case_dir, "1"))
    os.makedirs(os.path.join(case_dir, "data"))
    with open(os.path.join(case_dir, "1", "model.onnx"), "wb") as f:
        f.write(model_bytes)
    with open(os.path.join(case_dir, "config.pbtxt"), "w") as f:
        if explicit:
            f.write(explicit_config(name, graph, initializers))
        else:
            f.write(f'name: "{name}"\nplatform: "onnxruntime_onnx"\n')
    for file, raw in blobs:
        with open(os.path.join(case_dir, file), "wb") as f:
            f.write(raw)
    with open(os.path.join(case_dir, "data.json"), "w") as f:
        json.dump(tensors, f, indent=1)
    return {"name": name}


def stamp(explicit: bool) -> str:
    """Identifies what the output depends on: the onnx version, this script, the configs."""
    with open(__file__, "rb") as f:
        script = hashlib.sha256(f.read()).hexdigest()[:16]
    configs = "explicit configs" if explicit else "auto-complete configs"
    return f"onnx {onnx.__version__}, script {script}, {configs}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output folder (replaced)")
    parser.add_argument("--force", action="store_true", help="rewrite even when up to date")
    parser.add_argument(
        "--explicit-config",
        action="store_true",
        help="write complete configs instead of name + platform (to tell auto-complete "
        "problems from execution problems)",
    )
    args = parser.parse_args()
    out_dir = os.path.abspath(args.out)
    index_path = os.path.join(out_dir, "index.json")

    if not args.force and os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                old = json.load(f)
            if old.get("stamp") == stamp(args.explicit_config):
                print(f"{out_dir} is up to date ({old['stamp']}): {old['summary']}")
                return 0
        except (OSError, ValueError, KeyError):
            pass

    node_dir = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")
    if os.path.isdir(node_dir) and any(
        os.path.isfile(os.path.join(node_dir, d, "model.onnx")) for d in os.listdir(node_dir)
    ):
        source = node_dir
        cases = shipped_cases(node_dir)
    else:
        source = "generated from onnx.backend.test.case.node (the wheel ships no data/node)"
        cases = generated_cases()

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    entries = []
    with np.errstate(all="ignore"):
        for name, model_bytes, inputs, outputs in cases:
            try:
                entries.append(prepare_case(out_dir, name, model_bytes, inputs, outputs, args.explicit_config))
            except Skip as e:
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
                entries.append({"name": name, "skipped": str(e)})
    skipped = sum(1 for e in entries if "skipped" in e)
    summary = f"{len(entries)} cases, {len(entries) - skipped} prepared, {skipped} skipped (not representable)"
    with open(index_path, "w") as f:
        json.dump(
            {"stamp": stamp(args.explicit_config), "onnx_version": onnx.__version__, "source": source,
             "summary": summary, "cases": entries},
            f,
            indent=1,
        )
    print(f"onnx {onnx.__version__}, cases from {source}")
    print(f"wrote {out_dir}: {summary}")
    reasons = {}
    for e in entries:
        if "skipped" in e:
            key = re.sub(r"'[^']*' ", "", e["skipped"])
            reasons[key] = reasons.get(key, 0) + 1
    for reason, n in sorted(reasons.items(), key=lambda r: -r[1]):
        print(f"  skipped {n:4}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
