# SPDX-License-Identifier: Apache-2.0
# Builds and runs one consumer project of dml (cmake -P). MODE=find-package installs the current
# build tree into PREFIX first and builds tests/find-package against that prefix (and examples/learn's first
# program, which uses dml's public names only); MODE=add-subdirectory builds tests/add-subdirectory against the
# source tree.
# Inputs: MODE, DML_SOURCE_DIR, DML_BINARY_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, BUILD_TYPE;
# for find-package also PREFIX, and HAVE_MPI / HAVE_CUDA to check that the mpi and cuda
# components load their dependencies.
cmake_minimum_required(VERSION 3.25)

foreach(v MODE DML_SOURCE_DIR DML_BINARY_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run-consumer.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
string(TOUPPER "${BUILD_TYPE}" build_type_upper)

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${MODE}: ${what} failed (${rc})")
  endif()
endfunction()

# cmake -S src -B bin with the compiler and generator of the build under test; no package
# registry, so only the prefix can provide dml.
function(configure src bin)
  # The consumers prove that the public API suffices, not speed: -O0 compiles the learn examples in about 70%
  # of -O1's CPU time (learn_02: 22.9 s against 32.5 on a Zen 3), and they still run in seconds.
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${src} -B ${bin} -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=${BUILD_TYPE} "-DCMAKE_CXX_FLAGS_${build_type_upper}=-O0 -DNDEBUG"
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(configure_rc ${rc} PARENT_SCOPE)
  set(configure_log "${out}${err}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

if(MODE STREQUAL "find-package")
  if(NOT PREFIX)
    message(FATAL_ERROR "run-consumer.cmake: find-package needs -DPREFIX=...")
  endif()
  set(prefix ${PREFIX})
  file(REMOVE_RECURSE ${prefix})
  step("cmake --install" ${CMAKE_COMMAND} --install ${DML_BINARY_DIR} --prefix ${prefix} --component dml)
  foreach(f include/dml/core/tensor.hpp lib/cmake/dml/dml-config.cmake lib/cmake/dml/dml-config-version.cmake
            lib/cmake/dml/dml-targets.cmake lib/cmake/dml/dml-cuda-targets.cmake include/dml/plan/cost.hpp bin/dml-plan)
    if(NOT EXISTS ${prefix}/${f})
      message(FATAL_ERROR "${MODE}: the install lacks ${f}")
    endif()
  endforeach()

  set(src ${DML_SOURCE_DIR}/tests/find-package)
  set(common -DCMAKE_PREFIX_PATH=${prefix} -DDML_CONSUMER_PREFIX=${prefix})

  # An unknown component, and a version the package does not offer, must fail to configure.
  configure(${src} ${WORK_DIR}/bogus ${common} -DDML_CONSUMER_COMPONENTS=bogus -DDML_CONSUMER_CONFIGURE_ONLY=ON)
  if(configure_rc EQUAL 0 OR NOT configure_log MATCHES "no such component")
    message(FATAL_ERROR "${MODE}: find_package(dml COMPONENTS bogus) did not fail as it should:\n${configure_log}")
  endif()
  # The mpi component must bring MPI::MPI_CXX in with it.
  if(HAVE_MPI)
    configure(${src} ${WORK_DIR}/mpi ${common} -DDML_CONSUMER_COMPONENTS=mpi -DDML_CONSUMER_CONFIGURE_ONLY=ON)
    if(NOT configure_rc EQUAL 0)
      message(FATAL_ERROR "${MODE}: find_package(dml COMPONENTS mpi) failed:\n${configure_log}")
    endif()
  endif()
  # The cuda component must find the CUDA toolkit by itself, in a project without CUDA enabled.
  if(HAVE_CUDA)
    configure(${src} ${WORK_DIR}/cuda ${common} "-DDML_CONSUMER_COMPONENTS=cuda;nccl" -DDML_CONSUMER_CONFIGURE_ONLY=ON)
    if(NOT configure_rc EQUAL 0)
      message(FATAL_ERROR "${MODE}: find_package(dml COMPONENTS cuda nccl) failed:\n${configure_log}")
    endif()
  endif()
  set(bin ${WORK_DIR}/consumer)
  configure(${src} ${bin} ${common})
elseif(MODE STREQUAL "add-subdirectory")
  set(bin ${WORK_DIR}/consumer)
  configure(${DML_SOURCE_DIR}/tests/add-subdirectory ${bin} -DDML_SOURCE_DIR=${DML_SOURCE_DIR})
else()
  message(FATAL_ERROR "run-consumer.cmake: MODE is find-package or add-subdirectory, not '${MODE}'")
endif()

if(NOT configure_rc EQUAL 0)
  message(FATAL_ERROR "${MODE}: configuring the consumer failed:\n${configure_log}")
endif()
step("building the consumer" ${CMAKE_COMMAND} --build ${bin} --config ${BUILD_TYPE})
step("running the consumer" ${bin}/consumer)
# The learn example it built, as its test runs it (a second); a failed check exits non-zero.
if(MODE STREQUAL "find-package")
  step("running learn_01_one_rank" ${bin}/learn_01_one_rank)
endif()
