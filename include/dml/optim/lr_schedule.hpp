// SPDX-License-Identifier: Apache-2.0
// dml/optim/lr_schedule.hpp — forwarding header, kept for one release: optim/learning_rate.hpp.
#pragma once

#include "dml/optim/learning_rate.hpp"
