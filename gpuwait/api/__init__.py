"""gpuwait from Python: `gpuwait.reserve(...)` holds room for the calling process itself, for
code that no wrapper can start (notebooks, kernels, long-lived services), and `%gpuwait`, its
IPython magic. Imported only when used: `import gpuwait` stays cheap."""
