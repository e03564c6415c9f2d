#!/usr/bin/env python3
"""The ONNX node cases on a GPU, by kernel family and against the stand-in run
(scripts/gpu-check.sh's `conformance_diff` step).

Usage: gpu_conformance.py REPORT [--stand-in STAND_IN_REPORT] [--families a,b,...]

REPORT and STAND_IN_REPORT are tests/onnx_conformance.rs's report_gpu.tsv (case, outcome,
message): one from the device, one from the same cases against the stand-in CUDA libraries
(scripts/test.sh's gpu-check step keeps it in target/gpu-check-standin/, and
`gpu-check.sh --pack` takes it along). Prints, for each family (a substring of case names:
conv, gemm, ...), how many of its cases passed, failed and were refused (unsupported), then
every case whose outcome differs between the two runs.

Exit status 1 when a case that passed against the stand-in did not pass here (the device
computes something the host emulation of the same kernels does not), or when REPORT has
failures; other differences are listed and do not fail the step.
"""
import argparse
import sys

FAMILIES = ("conv,gemm,matmul,pool,reduce,softmax,gather,scatter,resize,pad,slice,concat,"
            "transpose,layer_norm,attention,topk,cumsum,lstm,einsum,split,tile,where,cast")


def read(path):
    out = {}
    with open(path) as f:
        for k, line in enumerate(f):
            cols = line.rstrip("\n").split("\t")
            if k == 0 and cols[0] == "case":
                continue
            if len(cols) >= 2:
                out[cols[0]] = (cols[1], cols[2] if len(cols) > 2 else "")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--stand-in", dest="stand_in")
    ap.add_argument("--families", default=FAMILIES)
    args = ap.parse_args()
    here = read(args.report)
    if not here:
        sys.exit(f"gpu_conformance: {args.report} lists no case")
    print("| family | cases | passed | failed | unsupported | not representable |")
    print("|---|---|---|---|---|---|")
    for fam in args.families.split(","):
        cases = [o for c, (o, _) in here.items() if fam in c]
        if cases:
            print(f"| {fam} | {len(cases)} | {cases.count('passed')} | {cases.count('failed')} "
                  f"| {cases.count('unsupported')} | {cases.count('not-representable')} |")
    total = list(o for o, _ in here.values())
    print(f"| (all) | {len(total)} | {total.count('passed')} | {total.count('failed')} "
          f"| {total.count('unsupported')} | {total.count('not-representable')} |")
    bad = [c for c, (o, _) in here.items() if o == "failed"]
    if not args.stand_in:
        print("\nno stand-in report to compare with")
    else:
        base = read(args.stand_in)
        differ = sorted(c for c in set(here) | set(base)
                        if here.get(c, ("absent", ""))[0] != base.get(c, ("absent", ""))[0])
        print(f"\nagainst the stand-in run ({args.stand_in}): {len(differ)} case(s) differ")
        for c in differ:
            o, msg = here.get(c, ("absent", ""))
            print(f"  {c}: stand-in {base.get(c, ('absent', ''))[0]}, here {o}"
                  + (f": {msg[:200]}" if msg else ""))
        bad += [c for c in differ if base.get(c, ("", ""))[0] == "passed" and c not in bad]
    if bad:
        print(f"\n{len(bad)} case(s) failed here or passed only on the stand-in: {', '.join(bad[:20])}")
        sys.exit(1)


if __name__ == "__main__":
    main()
