# vcpkg overlay port for accel.hpp: a thin wrapper of the project's own CMake
# install (accel.hpp and include/accel/, accelConfig.cmake with find_dependency(Torch), accel.pc).
# Use: vcpkg install accel --overlay-ports=<repo>/packaging/vcpkg
# SOURCE_PATH is this checkout; a published port would use vcpkg_from_github.
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DACCEL_BUILD_TESTS=OFF
    -DACCEL_BUILD_EXAMPLES=OFF
    -DACCEL_INSTALL=ON
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME accel CONFIG_PATH share/cmake/accel)
vcpkg_fixup_pkgconfig()

# Header-only: nothing architecture-specific, no debug tree.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
