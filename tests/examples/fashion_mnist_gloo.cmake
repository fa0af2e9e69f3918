# SPDX-License-Identifier: Apache-2.0
# --comm gloo as a user runs it: two processes, each named by DML_RANK, DML_WORLD_SIZE and DML_STORE (a file store
# in WORK), log the same losses, step by step, as --comm local --ranks 2 (two ranks sum in either order to the same
# floats); and a missing or malformed variable fails naming it.
# Usage: cmake -DEXE=... -DWORK=... -P fashion_mnist_gloo.cmake
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/store)
set(run --epochs 1 --steps 30 --parallel zero2)
set(env ${CMAKE_COMMAND} -E env DML_WORLD_SIZE=2 DML_STORE=file:${WORK}/store)

execute_process(COMMAND ${EXE} ${run} --comm local --ranks 2 --log ${WORK}/local.csv
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--comm local --ranks 2 failed (${rc}):\n${out}\n${err}")
endif()

# Both ranks at once: execute_process runs its commands side by side (rank 1's output goes to rank 0's input,
# which it does not read).
execute_process(COMMAND ${env} DML_RANK=1 ${EXE} ${run} --comm gloo
                COMMAND ${env} DML_RANK=0 ${EXE} ${run} --comm gloo --log ${WORK}/gloo.csv
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULTS_VARIABLE rcs TIMEOUT 240)
if(NOT rcs STREQUAL "0;0")
  message(FATAL_ERROR "--comm gloo on 2 processes failed (${rcs}):\n${out}\n${err}")
endif()
if(NOT out MATCHES "on 2 gloo rank\\(s\\)")
  message(FATAL_ERROR "expected 'on 2 gloo rank(s)' in rank 0's output, found:\n${out}")
endif()
file(READ ${WORK}/local.csv local)
file(READ ${WORK}/gloo.csv gloo)
string(REGEX MATCHALL "\n" rows "${gloo}")
list(LENGTH rows rows)
if(NOT rows EQUAL 31 OR NOT gloo STREQUAL local)
  message(FATAL_ERROR "expected --comm gloo to log --comm local's 30 steps, found:\n${gloo}\nbeside:\n${local}")
endif()
message(STATUS "--comm gloo on 2 processes logged --comm local --ranks 2's losses:\n${gloo}")

function(expect_error pattern)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=DML_RANK --unset=DML_WORLD_SIZE --unset=DML_STORE ${ARGN}
                          ${EXE} --comm gloo --steps 1
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(rc EQUAL 0 OR NOT err MATCHES "fashion_mnist: error: .*${pattern}")
    message(FATAL_ERROR "expected --comm gloo with ${ARGN} to fail with '${pattern}', found (${rc}):\n${out}\n${err}")
  endif()
  string(STRIP "${err}" err)
  message(STATUS "${ARGN}: ${err}")
endfunction()
expect_error("--comm gloo: expected the environment variable DML_WORLD_SIZE \\(the number of ranks\\), found it unset")
expect_error("--comm gloo: expected the environment variable DML_RANK \\(this process's rank\\), found it unset"
             DML_WORLD_SIZE=2)
expect_error("DML_RANK: expected an integer from 0 to 1, found '2'" DML_WORLD_SIZE=2 DML_RANK=2)
expect_error("DML_WORLD_SIZE: expected an integer, found 'two'" DML_WORLD_SIZE=two DML_RANK=0)
expect_error("--comm gloo: expected the environment variable DML_STORE \\(the rendezvous store, file:DIR\\), found it unset"
             DML_WORLD_SIZE=1 DML_RANK=0)
expect_error("dml::comm::open_store: expected an existing directory in 'file:${WORK}/none', found nothing"
             DML_WORLD_SIZE=1 DML_RANK=0 DML_STORE=file:${WORK}/none)
