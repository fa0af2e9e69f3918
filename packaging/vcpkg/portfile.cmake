# SPDX-License-Identifier: Apache-2.0
# vcpkg overlay port for dml: vcpkg install dml --overlay-ports=<dml>/packaging/vcpkg
# Builds from the source tree that holds this port; set DML_GIT_REF (and DML_GIT_URL) in the
# environment to build a given commit of a git repository instead.
set(VCPKG_BUILD_TYPE release)  # header-only: one configuration is all there is

if(DEFINED ENV{DML_GIT_REF})
  if(NOT DEFINED ENV{DML_GIT_URL})
    message(FATAL_ERROR "dml: DML_GIT_REF needs DML_GIT_URL, the repository to fetch")
  endif()
  vcpkg_from_git(OUT_SOURCE_PATH SOURCE_PATH URL "$ENV{DML_GIT_URL}" REF "$ENV{DML_GIT_REF}")
else()
  get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
endif()

# The features only pull in their dependencies: every component's targets are installed, and
# find_package(dml COMPONENTS ...) loads one when what it needs is found (packaging/vcpkg/usage).
vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS FEATURES cuda DML_ENABLE_CUDA)
vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DDML_BUILD_TESTS=OFF
    -DDML_BUILD_EXAMPLES=OFF
    -DDML_BUILD_BENCHMARKS=OFF
    -DDML_INSTALL=ON
    ${FEATURE_OPTIONS}
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME dml CONFIG_PATH lib/cmake/dml)

# Nothing is compiled: no libraries, no debug tree; the license goes where vcpkg wants it.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/share/doc")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
