# SPDX-License-Identifier: Apache-2.0
# --replicas refused where it cannot hold: with ddp (nothing to shard within a replica), 0, and a count that does not
# divide the data-parallel ranks; each with a clear message and a non-zero exit.
# Usage: cmake -DEXE=... -P fashion_mnist_replicas.cmake
function(expect_error pattern)
  execute_process(COMMAND ${EXE} ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(rc EQUAL 0 OR NOT err MATCHES "fashion_mnist: error: .*${pattern}")
    message(FATAL_ERROR "expected fashion_mnist ${ARGN} to fail with '${pattern}', found (${rc}):\n${out}\n${err}")
  endif()
  string(STRIP "${err}" err)
  message(STATUS "fashion_mnist ${ARGN}: ${err}")
endfunction()

expect_error("--replicas 2: hybrid sharding shards within each replica, so it needs --parallel zero1, zero2 or zero3; found --parallel ddp"
             --ranks 2 --replicas 2)
expect_error("--replicas: expected an integer >= 1, found '0'" --parallel zero1 --replicas 0)
expect_error("--replicas: expected an integer, found 'two'" --parallel zero1 --replicas two)
expect_error("--replicas: the 2 data-parallel ranks form replicas of equal size: expected a divisor of 2, found 4"
             --ranks 4 --pp 2 --parallel zero2 --replicas 4 --steps 1)
