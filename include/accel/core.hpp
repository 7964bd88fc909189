// accel/core.hpp: accel.hpp's parts that need no LibTorch: configuration, errors,
// enums, the environment, strategy validation and the local launcher (for
// launchers, configuration tools and programs that do not link LibTorch).
// accel.hpp with ACCEL_CORE_ONLY defined is the same, in one file.
//
// tools/amalgamate.py inlines the parts into accel.hpp each after the parts
// it includes, else in this order.
#pragma once

// ACCEL_HPP: set by accel.hpp too, so that including both forms in one
// translation unit, in either order, defines everything once.
#ifndef ACCEL_HPP
#define ACCEL_HPP

#include "accel/core/version.hpp"
#include "accel/core/config.hpp"
#include "accel/core/errors.hpp"
#include "accel/core/enums.hpp"
#include "accel/core/environment.hpp"
#include "accel/core/strategy.hpp"
#include "accel/core/launcher.hpp"
#include "accel/core/pipeline_actions.hpp"
#include "accel/core/pipeline_rules.hpp"
#include "accel/core/pipeline_orders.hpp"
#include "accel/core/pipeline_lowering.hpp"

#endif  // ACCEL_HPP
