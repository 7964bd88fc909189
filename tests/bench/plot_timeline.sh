#!/usr/bin/env bash
# The gradient buckets' timeline of one step (bench_sharding.cpp's TIMELINE lines, which run_sharding_bench.sh
# keeps in timeline.csv) as a PNG, with gnuplot (Debian: apt-get install gnuplot-nox): for each variant at
# WORLD processes, on rank 0, the forward and the backward as bars, and per bucket when it was ready (its last
# gradient arrived), issued, waited for and landed. Time runs from the forward's start; the backward starts
# where the hooks were armed.
#     bash tests/bench/plot_timeline.sh TIMELINE_CSV OUT_PNG [WORLD (2)] [VARIANTS (no_shard full_shard)]
set -euo pipefail
csv=${1:?usage: plot_timeline.sh TIMELINE_CSV OUT_PNG [WORLD] [VARIANTS]}
png=${2:?usage: plot_timeline.sh TIMELINE_CSV OUT_PNG [WORLD] [VARIANTS]}
world=${3:-2}
read -r -a variants <<< "${4:-no_shard full_shard}"
command -v gnuplot > /dev/null || { echo "plot_timeline.sh: needs gnuplot (apt-get install gnuplot-nox)" >&2; exit 1; }
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
# Per variant, one file of segments "y x_from x_to" for each kind (compute, issuing, in flight, waited), the
# times shifted by the forward's length so that the forward starts at 0. The last step of rank 0 wins.
row=0
for variant in "${variants[@]}"; do
  lines=$(awk -F, -v w="$world" -v v="$variant" '$1 == w && $2 == v && $3 == 0' "$csv" | tail -n 1000)
  [[ -n $lines ]] || { echo "plot_timeline.sh: no TIMELINE lines of $variant at $world processes in $csv" >&2; exit 1; }
  # (a file may hold several runs' lines: keep the last run's, the lines after the last bucket 0)
  lines=$(awk -F, '$4 == 0 { n = 0 } { kept[n++] = $0 } END { for (i = 0; i < n; ++i) print kept[i] }' <<< "$lines")
  awk -F, -v y0="$row" -v name="$variant" -v dir="$data" '
    { f = $10; bucket = $4; y = y0 + 1 + bucket
      printf "%g %g %g\n", y0, 0, f >> (dir "/forward")
      printf "%g %g %g\n", y0, f, f + $11 >> (dir "/backward")
      if ($6 >= 0) printf "%g %g\n", y, f + $6 >> (dir "/ready")
      printf "%g %g %g\n", y, f + ($6 >= 0 ? $6 : $12), f + $7 >> (dir "/issuing")
      printf "%g %g %g\n", y, f + $7, f + $8 >> (dir "/flight")
      printf "%g %g %g\n", y, f + $8, f + $9 >> (dir "/waited")
      printf "%g \"%s: bucket %d, %.1f MiB\"\n", y, name, bucket, $5 / 1048576 >> (dir "/labels") }
    END { printf "%g \"%s: forward, backward\"\n", y0, name >> (dir "/labels") }' <<< "$lines"
  row=$((row + $(wc -l <<< "$lines") + 2))
done
tics=$(awk '{ y = $1; $1 = ""; printf "%s%s %s", (NR > 1 ? ", " : ""), substr($0, 2), y }' "$data/labels")
gnuplot <<GP
set terminal png size 1100,$((160 + 34 * row)) noenhanced
set output '$png'
set title 'One step at $world processes, rank 0: when each gradient bucket was ready, issued, in flight and waited for'
set xlabel 'ms since the forward began'
set ytics ($tics)
set yrange [$row - 1:-1]
set grid xtics
set key outside bottom center horizontal
plot '$data/forward' using 2:1:(\$3 - \$2):(0) with vectors nohead lw 14 lc rgb '#9ecae1' title 'forward', \
     '$data/backward' using 2:1:(\$3 - \$2):(0) with vectors nohead lw 14 lc rgb '#3182bd' title 'backward (with finish)', \
     '$data/issuing' using 2:1:(\$3 - \$2):(0) with vectors nohead lw 10 lc rgb '#fd8d3c' title 'ready to issued (flattening, waiting for an earlier bucket)', \
     '$data/flight' using 2:1:(\$3 - \$2):(0) with vectors nohead lw 10 lc rgb '#74c476' title 'issued, not waited for yet (behind compute)', \
     '$data/waited' using 2:1:(\$3 - \$2):(0) with vectors nohead lw 10 lc rgb '#de2d26' title 'waited for (exposed)', \
     '$data/ready' using 2:1 with points pt 7 ps 1.2 lc rgb 'black' title 'last gradient ready'
GP
echo "plot_timeline.sh: $png"
