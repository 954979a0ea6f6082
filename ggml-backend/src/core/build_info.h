// Build information the CMake build passes as definitions (CMakeLists.txt); a compile outside it (the
// portability test) gets these placeholders.
#pragma once

#ifndef PI2_VERSION
#define PI2_VERSION "dev"
#endif
#ifndef PI2_LLAMA_CPP_PYTHON_VERSION
#define PI2_LLAMA_CPP_PYTHON_VERSION "unknown"
#endif
