# SPDX-License-Identifier: Apache-2.0
# dml-dependencies.cmake — finds what dml::dml's headers need on the host (oneDNN, OpenMP,
# nlohmann_json, zlib, Thrust/CUB headers). Included by the build tree and by dml-config.cmake.
include_guard(DIRECTORY)  # imported targets are directory-scoped: a sibling directory needs its own
include(CMakeFindDependencyMacro)

# In dml's own build a missing dependency is an error at once; inside find_package(dml) it
# makes dml not found, with the reason, as find_dependency does.
macro(_dml_find_dependency name)
  if(DML_DEPENDENCIES_REQUIRED)
    find_package(${name} ${ARGN} REQUIRED)
  else()
    find_dependency(${name} ${ARGN})
  endif()
endmacro()

# The versions dml builds with, as [first, last): the packaging recipes (packaging/conan, packaging/vcpkg)
# ask for the same ranges, and scripts/check-recipes compares them with this table and with what a
# configured build found (dml-dependencies-found.txt). oneDNN 2.6 (Debian 12) and 3.x (vcpkg, Conan) both
# work: core/detail/host_onednn.hpp keeps both API forms. The range is checked here, not by find_package,
# since oneDNN's version file accepts one major version only.
set(DML_DEPENDENCY_VERSIONS
  "dnnl 2.6 4"
  "nlohmann_json 3.11 4"
  "ZLIB 1.2.11 2"
  "Thrust 1.17 4")  # Debian 12's libthrust-dev is 1.17; the CUDA 13 toolkit has 3.0

# Sets ok to whether version lies in the table's range for name, and why to the message when it does not.
function(_dml_version_in_range name version ok why)
  foreach(row IN LISTS DML_DEPENDENCY_VERSIONS)
    string(REPLACE " " ";" row "${row}")
    list(GET row 0 row_name)
    if(row_name STREQUAL name)
      list(GET row 1 first)
      list(GET row 2 last)
      if(version VERSION_LESS first OR NOT version VERSION_LESS last)
        set(${ok} FALSE PARENT_SCOPE)
        set(${why} "dml: ${name} ${first} or newer and older than ${last} expected, found ${version}" PARENT_SCOPE)
      else()
        set(${ok} TRUE PARENT_SCOPE)
      endif()
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "dml: ${name} has no row in DML_DEPENDENCY_VERSIONS")
endfunction()

# Fails (own build) or makes dml not found (find_package(dml)) with why.
macro(_dml_dependency_unusable why)
  if(DML_DEPENDENCIES_REQUIRED)
    message(FATAL_ERROR "${why}")
  endif()
  set(${CMAKE_FIND_PACKAGE_NAME}_NOT_FOUND_MESSAGE "${why}")
  set(${CMAKE_FIND_PACKAGE_NAME}_FOUND FALSE)
  return()
endmacro()

_dml_find_dependency(OpenMP)
_dml_find_dependency(dnnl)
_dml_find_dependency(nlohmann_json)
_dml_find_dependency(ZLIB)
foreach(_dml_dep dnnl nlohmann_json ZLIB)
  set(_dml_version "${${_dml_dep}_VERSION}")
  if(_dml_dep STREQUAL "ZLIB")
    set(_dml_version "${ZLIB_VERSION_STRING}")
  endif()
  _dml_version_in_range(${_dml_dep} "${_dml_version}" _dml_ok _dml_why)
  if(NOT _dml_ok)
    _dml_dependency_unusable("${_dml_why}")
  endif()
endforeach()

# Thrust and CUB come with the CUDA toolkit (CCCL); on the host only their headers are used,
# so without a toolkit Debian's libthrust-dev and libcub-dev in /usr/include serve as well.
if(NOT TARGET dml::cccl)
  find_path(DML_CCCL_INCLUDE_DIR thrust/version.h
    HINTS ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} $ENV{CUDA_PATH} /usr/local/cuda
    PATH_SUFFIXES include/cccl targets/x86_64-linux/include/cccl targets/sbsa-linux/include/cccl include
    PATHS /usr/include
    DOC "Directory holding thrust/ and cub/")
  if(NOT DML_CCCL_INCLUDE_DIR)
    _dml_dependency_unusable("dml: Thrust/CUB headers not found; install the CUDA toolkit (or Debian's \
libthrust-dev and libcub-dev), or set DML_CCCL_INCLUDE_DIR to the folder that holds thrust/")
  endif()
  # THRUST_VERSION is MMMmmpp (1.17.2 is 101702, 3.0.1 is 300001).
  file(STRINGS "${DML_CCCL_INCLUDE_DIR}/thrust/version.h" _dml_thrust_line REGEX "^#define THRUST_VERSION [0-9]+")
  string(REGEX REPLACE "^#define THRUST_VERSION ([0-9]+).*" "\\1" _dml_thrust_code "${_dml_thrust_line}")
  math(EXPR _dml_thrust_major "${_dml_thrust_code} / 100000")
  math(EXPR _dml_thrust_minor "(${_dml_thrust_code} / 100) % 1000")
  math(EXPR _dml_thrust_patch "${_dml_thrust_code} % 100")
  set(DML_THRUST_FOUND_VERSION "${_dml_thrust_major}.${_dml_thrust_minor}.${_dml_thrust_patch}")
  _dml_version_in_range(Thrust "${DML_THRUST_FOUND_VERSION}" _dml_ok _dml_why)
  if(NOT _dml_ok)
    _dml_dependency_unusable("${_dml_why} (in ${DML_CCCL_INCLUDE_DIR}; set DML_CCCL_INCLUDE_DIR)")
  endif()
  add_library(dml::cccl INTERFACE IMPORTED)
  set_target_properties(dml::cccl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}")
endif()

# dml's own build records what it found, for scripts/check-recipes (the recipes' ranges must hold it).
if(DML_DEPENDENCIES_REQUIRED)
  file(WRITE "${CMAKE_BINARY_DIR}/dml-dependencies-found.txt"
    "dnnl ${dnnl_VERSION}\nnlohmann_json ${nlohmann_json_VERSION}\nZLIB ${ZLIB_VERSION_STRING}\n"
    "Thrust ${DML_THRUST_FOUND_VERSION}\nOpenMP ${OpenMP_CXX_VERSION}\n")
endif()
