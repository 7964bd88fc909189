#!/usr/bin/env bash
# A training run's loss (the metrics.csv that Accelerator::log writes with log_with csv) as a PNG, with gnuplot
# (Debian: apt-get install gnuplot-nox).
#     bash examples/plot_loss.sh train_llama_run/logs/metrics.csv loss.png [TITLE]
set -euo pipefail
csv=${1:?usage: plot_loss.sh METRICS_CSV OUT_PNG [TITLE]} png=${2:?usage: plot_loss.sh METRICS_CSV OUT_PNG [TITLE]}
title=${3:-training loss}
command -v gnuplot > /dev/null || { echo "plot_loss.sh: needs gnuplot (apt-get install gnuplot-nox)" >&2; exit 1; }
# The columns by name: the header may hold more keys (and in another order) than step, loss, lr.
read -r step_col loss_col lr_col < <(head -1 "$csv" | tr ',' '\n' | awk '
  $0 == "step" { s = NR } $0 == "loss" { l = NR } $0 == "lr" { r = NR } END { print s, l, (r ? r : 0) }')
lr_plot=""
if [[ $lr_col != 0 ]]; then
  lr_plot=", '$csv' using $step_col:$lr_col axes x1y2 with lines lc rgb 'gray' title 'learning rate'"
fi
gnuplot <<GP
set terminal png size 900,500 noenhanced
set output '$png'
set datafile separator ','
set key autotitle columnhead
set title '$title'
set xlabel 'optimizer step'
set ylabel 'loss (cross entropy per byte)'
set y2label 'learning rate'
set y2tics
set ytics nomirror
set grid
plot '$csv' using $step_col:$loss_col with lines lw 2 lc rgb '#1f77b4' title 'loss'$lr_plot
GP
echo "plot_loss.sh: $png"
