# SPDX-License-Identifier: Apache-2.0
# Trains a few steps with --save and --log, reloads the weights with --init and a zero learning rate, and
# checks that the reloaded model scores exactly the same test accuracy and that the CSV log is well formed.
# Usage: cmake -DEXE=... -DWORK=... -P fashion_mnist_roundtrip.cmake
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${EXE} --epochs 1 --steps 40 --save ${WORK}/w.safetensors --log ${WORK}/log.csv
  OUTPUT_VARIABLE first RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "first run failed (${rc}):\n${first}")
endif()
string(REGEX MATCH "test_accuracy=([0-9.]+)" _ "${first}")
set(acc1 ${CMAKE_MATCH_1})
execute_process(COMMAND ${EXE} --epochs 1 --steps 1 --lr 0 --init ${WORK}/w.safetensors --optimizer sgd
  OUTPUT_VARIABLE second RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "reload run failed (${rc}):\n${second}")
endif()
string(REGEX MATCH "test_accuracy=([0-9.]+)" _ "${second}")
set(acc2 ${CMAKE_MATCH_1})
if(NOT acc1 OR NOT acc1 STREQUAL acc2)
  message(FATAL_ERROR "expected the reloaded model to score ${acc1}, found '${acc2}'")
endif()
file(STRINGS ${WORK}/log.csv rows)
list(LENGTH rows n)
list(GET rows 0 header)
if(NOT header STREQUAL "step,epoch,loss,lr" OR NOT n EQUAL 41)
  message(FATAL_ERROR "expected a header and 40 rows in log.csv, found header '${header}' and ${n} lines")
endif()
execute_process(COMMAND ${EXE} --hidden 12,x OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(rc EQUAL 0 OR NOT err MATCHES "--hidden: expected a number, found 'x'")
  message(FATAL_ERROR "expected a clear error for --hidden 12,x, found (${rc}): ${err}")
endif()
message(STATUS "accuracy after 40 steps ${acc1}, reloaded ${acc2}")
