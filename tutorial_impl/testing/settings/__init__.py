"""The harness's settings: defaults, markers, options, the world-size matrix, clocks."""
