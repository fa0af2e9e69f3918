# SPDX-License-Identifier: Apache-2.0
# Finds what dml's headers need on the host; used by the build tree and by dml-config.cmake.
include_guard(GLOBAL)
include(CMakeFindDependencyMacro)
find_dependency(OpenMP)
find_dependency(dnnl)
find_dependency(nlohmann_json)
find_dependency(ZLIB)
# Thrust and CUB come with the CUDA toolkit (CCCL); on the host only their headers are used.
if(NOT TARGET dml::cccl)
  find_path(DML_CCCL_INCLUDE_DIR thrust/version.h
    HINTS ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} /usr/local/cuda
    PATH_SUFFIXES include/cccl targets/x86_64-linux/include/cccl include)
  if(NOT DML_CCCL_INCLUDE_DIR)
    message(FATAL_ERROR "dml: Thrust/CUB (CCCL) headers not found; install the CUDA toolkit or set DML_CCCL_INCLUDE_DIR")
  endif()
  add_library(dml::cccl INTERFACE IMPORTED)
  set_target_properties(dml::cccl PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${DML_CCCL_INCLUDE_DIR}")
endif()
