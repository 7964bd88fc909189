"""Conan 2 recipe for accel.hpp: a thin wrapper of the project's own CMake
install. Header-only, so the package id does not depend on settings.

    conan create packaging/conan --build=missing
"""
import os
import re

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load


class AccelConan(ConanFile):
    name = "accel"
    description = ("Distributed training helpers for LibTorch in one C++20 header: collectives over "
                   "tensors, scalars and std::vector, 2-D parallelism meshes, on c10d's Gloo and NCCL.")
    license = "MIT"
    topics = ("libtorch", "distributed", "header-only", "collectives")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    no_copy_source = True

    def _root(self):
        return os.path.join(self.recipe_folder, "..", "..")

    def export_sources(self):
        # The recipe lives in packaging/conan; the sources are the repository root.
        for pattern in ("accel.hpp", "include/*", "CMakeLists.txt", "cmake/*", "LICENSE"):
            copy(self, pattern, src=self._root(), dst=self.export_sources_folder)

    def set_version(self):
        header = load(self, os.path.join(self._root(), "accel.hpp"))
        parts = [re.search(rf"#define ACCEL_VERSION_{p} (\d+)", header).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        toolchain = CMakeToolchain(self)
        toolchain.variables["ACCEL_BUILD_TESTS"] = False
        toolchain.variables["ACCEL_BUILD_EXAMPLES"] = False
        toolchain.variables["ACCEL_INSTALL"] = True
        toolchain.generate()

    def package(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))

    def package_id(self):
        self.info.clear()

    def package_info(self):
        # LibTorch comes from the consumer's environment (find_package(Torch)),
        # as accelConfig.cmake does: there is no LibTorch package on ConanCenter.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs.append(os.path.join("share", "cmake", "accel"))
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
