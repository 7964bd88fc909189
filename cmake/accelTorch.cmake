# accel_prepare_torch(): call before find_package(Torch). It makes a pip
# wheel's LibTorch findable on any machine, with or without a CUDA toolkit,
# and keeps another LibTorch on the system from shadowing the one asked for.
#
# Why: a CUDA wheel's Caffe2Config.cmake (PyPI's torch, 2.x) looks for a CUDA
# toolkit of its own (nvcc, headers, cudart) and stops the configure with
#   "Your installed Caffe2 version uses CUDA but I cannot find the CUDA
#    libraries"                                         (no toolkit), or
#   "Found two conflicting CUDA versions"               (nvcc and headers differ;
#                                                        pytorch#64692),
# although a program that only calls LibTorch needs no toolkit at all: the
# wheel brings the CUDA runtime it was built with (site-packages/nvidia/...),
# and that runtime is the one its libraries load. Caffe2's CUDA lookup
# (public/cuda.cmake) returns at once when the target torch::cudart already
# exists (its include guard), and torch::cudart is the only CUDA target the
# exported LibTorch targets refer to. So for a wheel we define torch::cudart
# from the wheel's own runtime headers and library. A project that compiles
# CUDA code of its own and wants Caffe2's CUDA set-up calls find_package(Torch)
# before accel (then nothing here runs: torch already exists).
#
# TorchConfig.cmake also finds libtorch.so and libc10.so with find_library,
# which searches the system's prefixes before the LibTorch it came from: with
# Debian's libtorch-dev installed, a wheel's build reported "Found Torch:
# /usr/lib/x86_64-linux-gnu/libtorch.so". We point those cache entries at the
# LibTorch whose TorchConfig.cmake will be read.
#
# Some pip wheels (torch 2.5 to 2.11 at least: pytorch#133437) export the
# std::filesystem functions of a libstdc++ linked into libtorch.so and
# libtorch_cpu.so, and a program that lists those libraries before
# libstdc++ (as g++ and CMake do) calls their copies, some of which crash:
# std::filesystem::remove_all, which checkpoints use, jumps to address 0
# (seen with torch 2.11.0; a program of a few lines reproduces it). Linking
# libstdc++ first makes the program's calls take libstdc++'s own:
# ACCEL_TORCH_STDCXX_FIRST says to (a packaged LibTorch, not with libc++),
# and ACCEL_STDCXX_FIRST_FLAG is how: a linker flag that needs libstdc++
# whether or not the linker runs with --as-needed (Ubuntu's g++ does). A GCC
# that has only a static libstdc++.a (as the GPU machine's /opt/gcc) takes
# the same flag to link the runtime into the program ahead of LibTorch, so
# that the program supplies every std::filesystem function itself.
#
# Sets, for the caller: ACCEL_TORCH_ROOT (the LibTorch directory, or empty),
# and for a pip wheel ACCEL_TORCH_NCCL_INCLUDE_DIR (its nccl.h directory) and
# ACCEL_TORCH_CUDA_INCLUDE_DIR (its CUDA runtime headers), else empty;
# ACCEL_TORCH_WITHOUT_NCCL_PATH when a wheel's NCCL path cannot compile.
macro(accel_prepare_torch)
  set(ACCEL_TORCH_ROOT "")
  set(ACCEL_TORCH_WITHOUT_NCCL_PATH FALSE)
  set(ACCEL_TORCH_NCCL_INCLUDE_DIR "")
  set(ACCEL_TORCH_CUDA_INCLUDE_DIR "")
  set(ACCEL_TORCH_STDCXX_FIRST FALSE)
  set(ACCEL_STDCXX_FIRST_FLAG "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state")
  if(NOT TARGET torch)
    _accel_torch_config_dir(_accel_torch_dir)
    if(_accel_torch_dir)
      get_filename_component(ACCEL_TORCH_ROOT "${_accel_torch_dir}/../../.." ABSOLUTE)
      if(EXISTS "${ACCEL_TORCH_ROOT}/lib/libtorch.so")
        set(TORCH_LIBRARY "${ACCEL_TORCH_ROOT}/lib/libtorch.so" CACHE FILEPATH "LibTorch's libtorch.so" FORCE)
      endif()
      if(EXISTS "${ACCEL_TORCH_ROOT}/lib/libc10.so")
        set(c10_LIBRARY "${ACCEL_TORCH_ROOT}/lib/libc10.so" CACHE FILEPATH "LibTorch's libc10.so" FORCE)
      endif()
      _accel_wheel_cuda("${ACCEL_TORCH_ROOT}")
      if(NOT CMAKE_CXX_FLAGS MATCHES "-stdlib=libc\\+\\+")
        set(ACCEL_TORCH_STDCXX_FIRST TRUE)
      endif()
    endif()
  endif()
endmacro()

# The directory of the TorchConfig.cmake that find_package(Torch) will read:
# Torch_DIR if set, else the first match under CMAKE_PREFIX_PATH, the
# variable's then the environment's (a wheel's torch.utils.cmake_prefix_path
# is .../torch/share/cmake).
function(_accel_torch_config_dir out)
  set(_found "")
  if(Torch_DIR AND EXISTS "${Torch_DIR}/TorchConfig.cmake")
    set(_found "${Torch_DIR}")
  else()
    # (find_package reads the environment's CMAKE_PREFIX_PATH too, after the variable's.)
    set(_prefixes ${CMAKE_PREFIX_PATH})
    if(DEFINED ENV{CMAKE_PREFIX_PATH})
      string(REPLACE ":" ";" _env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
      list(APPEND _prefixes ${_env_prefixes})
    endif()
    foreach(_prefix IN LISTS _prefixes)
      foreach(_sub "Torch" "share/cmake/Torch")
        if(NOT _found AND EXISTS "${_prefix}/${_sub}/TorchConfig.cmake")
          get_filename_component(_found "${_prefix}/${_sub}" ABSOLUTE)
        endif()
      endforeach()
    endforeach()
  endif()
  set(${out} "${_found}" PARENT_SCOPE)
endfunction()

# A pip wheel keeps its CUDA runtime beside torch/ in site-packages/nvidia:
# nvidia/cu13/{include,lib} (CUDA 13 wheels) or nvidia/cuda_runtime/{include,lib}
# (CUDA 12 wheels), and NCCL in nvidia/nccl/{include,lib}.
macro(_accel_wheel_cuda torch_root)
  get_filename_component(_accel_nvidia "${torch_root}/../nvidia" ABSOLUTE)
  if(EXISTS "${torch_root}/share/cmake/Caffe2/public/cuda.cmake" AND IS_DIRECTORY "${_accel_nvidia}"
     AND NOT TARGET torch::cudart)
    file(GLOB _accel_cudart LIST_DIRECTORIES false "${_accel_nvidia}/cu*/lib/libcudart.so.*"
                                                   "${_accel_nvidia}/cuda_runtime/lib/libcudart.so.*")
    list(FILTER _accel_cudart EXCLUDE REGEX "\\.a$")
    if(_accel_cudart)
      list(GET _accel_cudart 0 _accel_cudart)
      get_filename_component(_accel_cuda_dir "${_accel_cudart}/../.." ABSOLUTE)
      set(ACCEL_TORCH_CUDA_INCLUDE_DIR "${_accel_cuda_dir}/include")
      add_library(torch::cudart INTERFACE IMPORTED)
      set_target_properties(torch::cudart PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${_accel_cuda_dir}/include"
        INTERFACE_LINK_LIBRARIES "${_accel_cudart}")
      message(STATUS "accel: LibTorch from a pip wheel; its CUDA runtime: ${_accel_cudart} "
                     "(Caffe2's CUDA toolkit lookup skipped)")
    endif()
    # The wheel's cuda_runtime.h includes crt/host_config.h, which only a CUDA
    # toolkit or `pip install "cuda-toolkit[crt]"` brings. A toolkit's (at
    # CUDA_HOME, CUDA_PATH or /usr/local/cuda) is searched after the wheel's
    # headers. Without either the NCCL path cannot compile: it is left off
    # (ACCEL_WITH_NCCL=0), with the reason.
    if(ACCEL_TORCH_CUDA_INCLUDE_DIR AND NOT EXISTS "${ACCEL_TORCH_CUDA_INCLUDE_DIR}/crt/host_config.h")
      find_path(ACCEL_CUDA_CRT_INCLUDE_DIR crt/host_config.h
                HINTS "$ENV{CUDA_HOME}/include" "$ENV{CUDA_PATH}/include" /usr/local/cuda/include NO_DEFAULT_PATH)
    endif()
    if(ACCEL_CUDA_CRT_INCLUDE_DIR AND TARGET torch::cudart)
      set_property(TARGET torch::cudart APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${ACCEL_CUDA_CRT_INCLUDE_DIR}")
      message(STATUS "accel: crt/host_config.h from the CUDA toolkit in ${ACCEL_CUDA_CRT_INCLUDE_DIR}")
    endif()
    if(ACCEL_TORCH_CUDA_INCLUDE_DIR AND NOT EXISTS "${ACCEL_TORCH_CUDA_INCLUDE_DIR}/crt/host_config.h"
       AND NOT ACCEL_CUDA_CRT_INCLUDE_DIR)
      message(WARNING "accel: the wheel's CUDA headers lack crt/host_config.h, so accel.hpp's NCCL path is off "
                      "(ACCEL_WITH_NCCL=0; Gloo works). To compile it: pip install \"cuda-toolkit[crt]\" "
                      "in the same environment as torch, or set CUDA_HOME to a CUDA toolkit.")
      set(ACCEL_TORCH_WITHOUT_NCCL_PATH TRUE)
    elseif(EXISTS "${_accel_nvidia}/nccl/include/nccl.h")
      set(ACCEL_TORCH_NCCL_INCLUDE_DIR "${_accel_nvidia}/nccl/include")
    endif()
  endif()
endmacro()
