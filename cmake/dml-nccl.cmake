# SPDX-License-Identifier: Apache-2.0
# dml-nccl.cmake — provides the imported target NCCL::nccl that dml::nccl links (NCCL ships no
# CMake config). Included by the build tree and by dml-config.cmake for the nccl component.
include_guard(DIRECTORY)  # imported targets are directory-scoped: a sibling directory needs its own

if(NOT TARGET NCCL::nccl)
  # The CUDA 13 toolkit here keeps NCCL in <cuda>/lib; distributions use lib64 or lib/<triple>.
  set(_dml_nccl_roots ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_ROOT}
    $ENV{CUDA_HOME} /usr/local/cuda)
  find_library(DML_NCCL_LIBRARY NAMES nccl HINTS ${_dml_nccl_roots} ${CUDAToolkit_LIBRARY_DIR}
    PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu DOC "NCCL's shared library")
  find_path(DML_NCCL_INCLUDE_DIR nccl.h HINTS ${_dml_nccl_roots} ${CUDAToolkit_INCLUDE_DIRS}
    PATH_SUFFIXES include DOC "Directory holding nccl.h")
  unset(_dml_nccl_roots)
  if(DML_NCCL_LIBRARY AND DML_NCCL_INCLUDE_DIR)
    add_library(NCCL::nccl SHARED IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${DML_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${DML_NCCL_INCLUDE_DIR}")
  endif()
endif()
