/* The kernels ship as an extension module so that pip builds them with the package; Python
 * calls them through ctypes (hetspec/native/kernels.py), so the module itself is empty. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hsnative",
                                    "hetspec's native CPU kernels (see hsnative.h)", -1, NULL};

PyMODINIT_FUNC PyInit__hsnative(void) { return PyModule_Create(&module); }
