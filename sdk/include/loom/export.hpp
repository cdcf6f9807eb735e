#pragma once
// Plugins build with -fvisibility=hidden; everything the host and plugins share (interface classes,
// their typeinfo and vtables, SDK helpers) must carry default visibility so dynamic_cast and
// exceptions work across library boundaries.
#define LOOM_API __attribute__((visibility("default")))
