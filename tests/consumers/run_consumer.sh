#!/usr/bin/env bash
# Builds and runs (on 2 ranks) an out-of-tree consumer of accel.hpp.
#   run_consumer.sh find_package|add_subdirectory|fetchcontent SOURCE_DIR LAUNCHER
set -euo pipefail
mode=$1
source_dir=$2
launcher=$3
here=$(cd "$(dirname "$0")" && pwd)
# With a pip wheel's LibTorch the program must load libstdc++ first
# (tests/needed_order.sh says why); elsewhere the order does not matter.
check_order() {
  if ldd "$1" | grep -q 'libtorch_cpu.so => .*site-packages'; then bash "$here/../needed_order.sh" "$1"; fi
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
configure=(cmake -S "$here/$mode" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release)

case $mode in
  find_package)
    cmake -S "$source_dir" -B "$work/accel" -DCMAKE_INSTALL_PREFIX="$work/prefix" \
      -DACCEL_BUILD_TESTS=OFF -DACCEL_BUILD_EXAMPLES=OFF -DACCEL_INSTALL=ON >/dev/null
    cmake --install "$work/accel" >/dev/null
    for f in include/accel.hpp include/accel/core.hpp include/accel/distributed.hpp include/accel/training.hpp \
             include/accel/distributed/collectives.hpp share/cmake/accel/accelConfig.cmake share/cmake/accel/accelConfigVersion.cmake \
             share/cmake/accel/accelTargets.cmake share/pkgconfig/accel.pc; do
      [[ -f $work/prefix/$f ]] || { echo "not installed: $f"; exit 1; }
    done
    echo "installed: $(cd "$work/prefix" && find . -type f | sort | tr '\n' ' ')"
    # SameMajorVersion: a newer major version must not be accepted.
    if cmake -S "$here/$mode" -B "$work/too-new" -DCMAKE_PREFIX_PATH="$work/prefix" \
         -DACCEL_WANT_VERSION=99.0 >/dev/null 2>&1; then
      echo "find_package(accel 99.0) was accepted by version $(grep -m1 PACKAGE_VERSION "$work/prefix/share/cmake/accel/accelConfigVersion.cmake")"
      exit 1
    fi
    if command -v pkg-config >/dev/null && [[ ${ACCEL_CONSUMER_PKG_CONFIG:-1} != 0 ]]; then
      # The installed accel.pc builds the consumer and runs it, through the
      # installed include tree (accel/distributed.hpp) rather than accel.hpp,
      # which the CMake consumer below includes.
      pc=(env PKG_CONFIG_PATH="$work/prefix/share/pkgconfig" pkg-config)
      echo "pkg-config --cflags --libs accel: $("${pc[@]}" --cflags --libs accel)"
      # shellcheck disable=SC2046 (the flags are words)
      g++ -DACCEL_CONSUMER_INCLUDE_TREE "$here/main.cpp" -o "$work/consumer_pc" $("${pc[@]}" --cflags --libs accel)
      check_order "$work/consumer_pc"
      pc_output=$("$launcher" --timeout 120 2 "$work/consumer_pc")
      grep -q "consumer ok: sum 3 on 2 ranks" <<<"$pc_output" || { echo "$pc_output"; exit 1; }
    fi
    configure+=(-DCMAKE_PREFIX_PATH="$work/prefix")
    ;;
  add_subdirectory)
    configure+=(-DACCEL_SOURCE_DIR="$source_dir")
    ;;
  fetchcontent)
    configure+=(-DACCEL_GIT_REPOSITORY="file://$source_dir" -DFETCHCONTENT_SOURCE_DIR_ACCEL="$source_dir"
                -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac

"${configure[@]}" >/dev/null
cmake --build "$work/consumer" -j2
if [[ $mode != find_package ]] && [[ -e $work/consumer/accel/tests ]]; then
  echo "the accel subproject built its tests: they must be off when it is not top-level"
  exit 1
fi
check_order "$work/consumer/consumer"
output=$("$launcher" --timeout 120 2 "$work/consumer/consumer")
echo "$output"
grep -q "consumer ok: sum 3 on 2 ranks" <<<"$output"
