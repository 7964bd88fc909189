#!/usr/bin/env bash
# Compile cost of one translation unit, side by side in one run: accel.hpp
# with one all_reduce called against the raw c10d program that does the same
# (a Gloo group, allreduce()->wait(), over the same includes), the target
# being <= 1.25x at -O2; with <ATen/ATen.h> alone and <torch/torch.h> for
# scale. -O0 and -O2, interleaved, five rounds (ACCEL_BENCH_ROUNDS); medians
# of wall seconds and peak memory. Two more rows say where accel.hpp's time
# goes: the header included with nothing called, and a file of only the
# headers accel.hpp includes (its preprocessor lines, no code of its own: the
# floor any header built on c10d pays). Writes
# tests/bench/results/compile.{csv,md} (ACCEL_BENCH_OUT elsewhere). Needs a
# quiet machine: never part of the test command. ACCEL_BENCH_INSTRUCTIONS=1
# also counts the compiler's instructions under valgrind's cachegrind (about
# a quarter of an hour more): a figure that a busy machine does not change. LibTorch's headers come from
# ACCEL_BENCH_TORCH_INCLUDE (default /usr/include, Debian's 1.13). Elsewhere:
#     bash tests/trixie/in_root.sh ROOT env ACCEL_BENCH_OUT=... bash tests/bench/run_compile_bench.sh
#     ACCEL_BENCH_OUT=... ACCEL_BENCH_TORCH_INCLUDE=$(build/pip-venv/bin/python -c \
#       'import torch.utils.cpp_extension as e; print(e.include_paths()[0])') bash tests/bench/run_compile_bench.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${ACCEL_BENCH_OUT:-$root/tests/bench/results}
rounds=${ACCEL_BENCH_ROUNDS:-5}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '#include "accel.hpp"\nint main() { return accel::all_reduce(1) - 1; }\n' >"$tmp/accel.cpp"
printf '#include "accel.hpp"\nint main() { return at::ones({1}).item<int>() - 1; }\n' >"$tmp/parse.cpp"
printf '#include <ATen/ATen.h>\nint main() { return at::ones({1}).item<int>() - 1; }\n' >"$tmp/aten.cpp"
printf '#include <torch/torch.h>\nint main() { return torch::ones({1}).item<int>() - 1; }\n' >"$tmp/torch.cpp"
# accel.hpp's preprocessor skeleton up to the opt-in training part: the same
# conditions, macros and includes, none of its code.
/usr/bin/python3 - "$root/accel.hpp" "$tmp" <<'PY'
import re, sys
text = open(sys.argv[1]).read().split("// == accel/training/")[0].replace("\\\n", " ")
lines = [l for l in text.splitlines() if re.match(r"\s*#\s*(include|if|ifdef|ifndef|elif|else|endif|define|error)\b", l)]
depth = sum(1 if re.match(r"\s*#\s*if", l) else -1 if re.match(r"\s*#\s*endif", l) else 0 for l in lines)
lines += ["#endif"] * depth  # the training part's section is cut open
skeleton = "\n".join(lines) + "\n"
open(f"{sys.argv[2]}/includes.cpp", "w").write(skeleton + "int main() { return at::ones({1}).item<int>() - 1; }\n")
open(f"{sys.argv[2]}/raw.cpp", "w").write(skeleton + """int main() {
  auto store = c10::make_intrusive<c10d::FileStore>("/tmp/unused", 1);
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, c10d::ProcessGroupGloo::Options::create());
  std::vector<at::Tensor> data{at::ones({1}, at::kInt)};
  group->allreduce(data)->wait();
  return data[0].item<int>() - 1;
}
""")
PY
/usr/bin/python3 - "$tmp" "$root" "$out" "$rounds" "${ACCEL_BENCH_TORCH_INCLUDE:-/usr/include}" <<'PY'
import csv, os, statistics, subprocess, sys, time
tmp, root, out, rounds, torch_include = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
tus = [("accel", "`accel.hpp`, one `all_reduce` called"), ("parse", "`accel.hpp`, nothing called"),
       ("includes", "accel.hpp's includes only (the floor)"),
       ("raw", "the same includes, one raw c10d `allreduce()->wait()`"), ("aten", "`<ATen/ATen.h>`"),
       ("torch", "`<torch/torch.h>`")]
rows = []
for _ in range(rounds):
    for opt in ("O0", "O2"):
        for tu, _name in tus:
            # (-I/usr/include would break the standard headers' #include_next.)
            cmd = ["g++", "-std=c++20", f"-{opt}", f"-I{root}"] + \
                  ([f"-I{torch_include}"] if torch_include != "/usr/include" else []) + \
                  [f"-I{torch_include}/torch/csrc/api/include",
                   "-c", f"{tmp}/{tu}.cpp", "-o", f"{tmp}/{tu}.o"]
            start = time.perf_counter()
            child = subprocess.Popen(cmd)
            _, status, usage = os.wait4(child.pid, 0)
            seconds = time.perf_counter() - start
            if status != 0:
                sys.exit(f"compile failed: {' '.join(cmd)}")
            rows.append({"opt": opt, "tu": tu, "seconds": f"{seconds:.2f}", "peak_mib": usage.ru_maxrss // 1024})
            print(",".join(str(v) for v in rows[-1].values()), file=sys.stderr)
with open(f"{out}/compile.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["opt", "tu", "seconds", "peak_mib"])
    w.writeheader()
    w.writerows(rows)
def med(opt, tu, key):
    return statistics.median(float(r[key]) for r in rows if r["opt"] == opt and r["tu"] == tu)
compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
version = {}
# (2.15 moved the numbers to torch/headeronly/version.h, which the old path includes.)
for header in ("torch/csrc/api/include/torch/version.h", "torch/headeronly/version.h"):
    if os.path.exists(f"{torch_include}/{header}"):
        for line in open(f"{torch_include}/{header}"):
            words = line.split()
            if len(words) == 3 and words[0] == "#define" and words[1] in ("TORCH_VERSION_MAJOR", "TORCH_VERSION_MINOR"):
                version[words[1]] = words[2]
torch_version = f"{version.get('TORCH_VERSION_MAJOR', '?')}.{version.get('TORCH_VERSION_MINOR', '?')}"
lines = [f"# Compile cost of one translation unit ({compiler}, LibTorch {torch_version}, -std=c++20 -c; "
         f"medians of {rounds} interleaved rounds)", "",
         "| translation unit | -O0 s | -O0 MiB | -O0 ratio | -O2 s | -O2 MiB | -O2 ratio |",
         "|---|---:|---:|---:|---:|---:|---:|"]
for tu, name in tus:
    cells = []
    for opt in ("O0", "O2"):
        s = med(opt, tu, "seconds")
        cells += [f"{s:.2f}", f"{med(opt, tu, 'peak_mib'):.0f}", f"{s / med(opt, 'aten', 'seconds'):.2f}"]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
a, p, i, r, t = (med("O2", tu, "seconds") for tu in ("accel", "parse", "includes", "raw", "aten"))
ratio = a / r
lines += ["", f"At -O2: the includes alone {i / t:.2f}x the ATen-only file; accel.hpp's own code {a - i:.2f} s above "
          f"them ({p - i:.2f} s to parse, {a - p:.2f} s for the one call, where the raw c10d call costs {r - i:.2f} s).",
          f"Target: accel.hpp with one all_reduce <= 1.25x the raw c10d program at -O2: {a:.2f} / {r:.2f} s = "
          f"{ratio:.2f}, {'met' if ratio <= 1.25 else 'NOT met'}."]
if os.environ.get("ACCEL_BENCH_INSTRUCTIONS") == "1":
    # The instructions the compiler proper (cc1plus: preprocessing, parsing,
    # code generation; not the assembler) executes at -O2, counted by
    # cachegrind: the same on a busy machine as on a quiet one, where wall
    # seconds are not. About four minutes per file, two at a time.
    import concurrent.futures, re, shlex
    def instructions(tu):
        flags = ["-std=c++20", "-O2", f"-I{root}"] + \
                ([f"-I{torch_include}"] if torch_include != "/usr/include" else []) + \
                [f"-I{torch_include}/torch/csrc/api/include", "-c", f"{tmp}/{tu}.cpp", "-o", f"{tmp}/{tu}.o"]
        driver = subprocess.run(["g++", *flags, "-###"], capture_output=True, text=True).stderr
        cc1 = shlex.split(next(l for l in driver.splitlines() if "cc1plus" in l))
        cc1[cc1.index("-o") + 1] = f"{tmp}/{tu}.s"
        run = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *cc1],
                             capture_output=True, text=True)
        return int(re.search(r"I\s+refs:\s+([\d,]+)", run.stderr).group(1).replace(",", ""))
    counted = ("accel", "parse", "includes", "raw")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        count = dict(zip(counted, pool.map(instructions, counted)))
    lines += ["", "Instructions the compiler executes at -O2 (cachegrind, once each: deterministic):", "",
              "| translation unit | instructions (G) | ratio to raw c10d |", "|---|---:|---:|"]
    for tu, name in tus:
        if tu in count:
            lines.append(f"| {name} | {count[tu] / 1e9:.2f} | {count[tu] / count['raw']:.3f} |")
    ratio = count["accel"] / count["raw"]
    lines += ["", f"Target in instructions: {ratio:.3f}, {'met' if ratio <= 1.25 else 'NOT met'}."]
open(f"{out}/compile.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
