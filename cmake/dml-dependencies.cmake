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

_dml_find_dependency(OpenMP)
_dml_find_dependency(dnnl)
_dml_find_dependency(nlohmann_json)
_dml_find_dependency(ZLIB)

# Thrust and CUB come with the CUDA toolkit (CCCL); on the host only their headers are used,
# so without a toolkit Debian's libthrust-dev and libcub-dev in /usr/include serve as well.
if(NOT TARGET dml::cccl)
  find_path(DML_CCCL_INCLUDE_DIR thrust/version.h
    HINTS ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} $ENV{CUDA_PATH} /usr/local/cuda
    PATH_SUFFIXES include/cccl targets/x86_64-linux/include/cccl targets/sbsa-linux/include/cccl include
    PATHS /usr/include
    DOC "Directory holding thrust/ and cub/")
  if(NOT DML_CCCL_INCLUDE_DIR)
    set(_dml_cccl_message "dml: Thrust/CUB headers not found; install the CUDA toolkit (or Debian's \
libthrust-dev and libcub-dev), or set DML_CCCL_INCLUDE_DIR to the folder that holds thrust/")
    if(DML_DEPENDENCIES_REQUIRED)
      message(FATAL_ERROR "${_dml_cccl_message}")
    endif()
    set(${CMAKE_FIND_PACKAGE_NAME}_NOT_FOUND_MESSAGE "${_dml_cccl_message}")
    set(${CMAKE_FIND_PACKAGE_NAME}_FOUND FALSE)
    return()
  endif()
  add_library(dml::cccl INTERFACE IMPORTED)
  set_target_properties(dml::cccl PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}")
endif()
