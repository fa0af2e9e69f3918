# SPDX-License-Identifier: Apache-2.0
# Runs a program as a test must: it passes only if the program exits with EXIT (default 0) AND its output
# (stdout and stderr together) matches PATTERN. ctest's PASS_REGULAR_EXPRESSION alone ignores the exit code,
# so a program that prints the right line and then crashes would pass.
#   cmake -DPATTERN=<regex> [-DEXIT=<code>] -P expect_output.cmake <program> [arguments...]
if(NOT DEFINED PATTERN)
  message(FATAL_ERROR "expect_output.cmake: give -DPATTERN=<regex>")
endif()
if(NOT DEFINED EXIT)
  set(EXIT 0)
endif()
# The command is everything after this script's path.
set(command)
set(after_script OFF)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_script)
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL CMAKE_CURRENT_LIST_FILE OR CMAKE_ARGV${i} MATCHES "expect_output\\.cmake$")
    set(after_script ON)
  endif()
endforeach()
if(NOT command)
  message(FATAL_ERROR "expect_output.cmake: no program to run after the script's path")
endif()
execute_process(COMMAND ${command} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT code STREQUAL "${EXIT}")
  message(FATAL_ERROR "expect_output: ${command} exited with ${code}, expected ${EXIT}")
endif()
if(NOT out MATCHES "${PATTERN}")
  message(FATAL_ERROR "expect_output: the output of ${command} does not match: ${PATTERN}")
endif()
message("expect_output: exit ${code} and the output matches")
