/* fastbert.kernels.launch's cached launch, in C: the same key, dictionary lookup and launcher call as
 * KernelLauncher.__call__, without the interpreter's work between them (kernels/launch.py's header says what
 * the key holds and why). Built at first import with Triton's own helper (triton.runtime.build, which builds
 * Triton's launchers the same way); where it cannot be built (no C compiler or no Python headers), launch.py
 * keeps its Python path.
 *
 * launch(kernel, grid, *args, **constexprs) builds the exact key of a call: the kernel's id, the device and the
 * driver, the arguments' types, each int's value (bools and int subclasses too), each tensor's dtype, the tensors'
 * 16-byte alignment (one True when all are aligned, else a tuple of each tensor's), the constexprs' names (one
 * tuple: a call site passes the same) and values, and looks it up among the kept entries (a dictionary; in front
 * of it, a cache of the calls last launched matches a call by its raw words without building the key: `describe`,
 * below). A key it has kept launches its entry at once: the Triton launcher, called with the grid, the stream, the
 * launcher's head, the arguments and the entry's tail; each tensor of a plain tensor type (torch.Tensor,
 * nn.Parameter) goes to the launcher as the address the key read, which Triton's launcher takes as it is: given
 * the tensor, it would call its data_ptr again and ask the CUDA driver about the address (cuPointerGetAttribute),
 * per tensor per launch, to reject a CPU tensor, which fastbert's ops rejected before any launch
 * (fastbert.ops.resolve_backend). Any other call (the first of a key, one with a launch hook installed, or one its
 * kept entry cannot launch) goes to the Python path, launch.py's `_launch_python(kernel, grid, args, constexprs)`,
 * which returns (what launch returns, the entry to keep for this key or None); its entry is kept. An entry holds
 * its kernel, whose id the key holds: while it is kept, no other kernel can take that id. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_KEPT 65536 /* keys kept, all kernels together; past this the cache starts again */
#define MAX_ARGS 256

static PyObject *drivers, *runtime_knobs, *tensor_type, *tensor_data_ptr, *plain_tensor_types, *slow_path, *kept;
#define MAX_PLAIN 4
static PyTypeObject *plain_types[MAX_PLAIN]; /* plain_tensor_types' items, compared by identity */
static Py_ssize_t nplain;
static PyObject *s_active_attr, *s_active, *s_get_current_device, *s_get_current_stream, *s_dtype, *s_data_ptr,
    *s_enter, *s_exit, *s_calls;

static int hooked(void) {
    /* A profiler's launch hook installed: Triton 3.6-3.9 keep the hooks in (normally empty) chains, whose
     * `calls` list holds them; a callable set in a chain's place is a hook itself, None none. */
    PyObject *names[2] = {s_enter, s_exit};
    for (int i = 0; i < 2; i++) {
        PyObject *hook = PyObject_GetAttr(runtime_knobs, names[i]);
        if (hook == NULL) return -1;
        PyObject *calls = PyObject_GetAttr(hook, s_calls);
        if (calls == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                Py_DECREF(hook);
                return -1;
            }
            PyErr_Clear();
            calls = hook;
            Py_INCREF(calls);
        }
        int set = PyObject_IsTrue(calls);
        Py_DECREF(calls);
        Py_DECREF(hook);
        if (set != 0) return set;
    }
    return 0;
}

static PyObject *driver_now(void) {
    PyObject *driver = PyObject_GetAttr(drivers, s_active_attr); /* the attribute, once set */
    if (driver == Py_None) {
        Py_DECREF(driver);
        driver = PyObject_GetAttr(drivers, s_active);
    }
    return driver;
}

/* What one pass over a call's arguments reads (scan_args): how many are ints, and each tensor's place, dtype (a
 * new reference, released by scan_release) and address's low 4 bits. */
typedef struct {
    Py_ssize_t ints, tensors;
    size_t any_low;
    int tensor_at[MAX_ARGS];
    PyObject *dtypes[MAX_ARGS];
    size_t low_bits[MAX_ARGS];
} Scan;

static void scan_release(Scan *scan) {
    for (Py_ssize_t t = 0; t < scan->tensors; t++) Py_DECREF(scan->dtypes[t]);
    scan->tensors = 0;
}

/* 0, or -1 with an exception set. pointers[i] (nargs of them, NULL on entry) gets a new reference to the address
 * of args[i] where it is a tensor of a plain type (the header), for the launcher; the caller releases them and
 * the scan (scan_release), after a failure too. */
static int scan_args(PyObject *const *args, Py_ssize_t nargs, PyObject **pointers, Scan *scan) {
    scan->ints = scan->tensors = 0;
    scan->any_low = 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyLong_Check(args[i])) { /* bools and int subclasses too: Triton specialises any int by value */
            scan->ints++;
        } else if (PyObject_TypeCheck(args[i], (PyTypeObject *)tensor_type)) {
            /* torch.Tensor's own data_ptr, as the Python path calls it (a subclass may override it) */
            PyObject *pointer = PyObject_CallOneArg(tensor_data_ptr, args[i]);
            if (pointer == NULL) return -1;
            size_t address = (size_t)PyLong_AsUnsignedLongLongMask(pointer);
            int plain = 0;
            for (Py_ssize_t k = 0; k < nplain; k++) plain |= Py_TYPE(args[i]) == plain_types[k];
            if (plain) {
                pointers[i] = pointer;
            } else {
                Py_DECREF(pointer);
            }
            if (PyErr_Occurred()) return -1;
            PyObject *dtype = PyObject_GetAttr(args[i], s_dtype);
            if (dtype == NULL) return -1;
            Py_ssize_t t = scan->tensors++;
            scan->tensor_at[t] = (int)i;
            scan->dtypes[t] = dtype;
            scan->low_bits[t] = address & 15;
            scan->any_low |= address & 15;
        }
    }
    return 0;
}

/* The exact key of a call, from its scan; NULL with an exception set on failure. */
static PyObject *call_key(PyObject *kernel, PyObject *device, PyObject *driver, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames, PyObject *const *kwvalues, Py_ssize_t nkw,
                          const Scan *scan) {
    PyObject *types = PyTuple_New(nargs);
    if (types == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(types, i, Py_NewRef((PyObject *)Py_TYPE(args[i])));
    /* kernel id, device, driver, types, ints, dtypes, alignment, constexpr names, constexpr values */
    Py_ssize_t size = 4 + scan->ints + scan->tensors + 1 + 1 + nkw, at = 0;
    PyObject *key = PyTuple_New(size);
    if (key == NULL) {
        Py_DECREF(types);
        return NULL;
    }
    /* unfilled items are NULL, which a tuple's dealloc skips */
    PyObject *id = PyLong_FromVoidPtr(kernel);
    if (id == NULL) goto fail;
    PyTuple_SET_ITEM(key, at++, id);
    PyTuple_SET_ITEM(key, at++, Py_NewRef(device));
    PyTuple_SET_ITEM(key, at++, Py_NewRef(driver));
    PyTuple_SET_ITEM(key, at++, types); /* the key owns it now */
    types = NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyLong_Check(args[i])) PyTuple_SET_ITEM(key, at++, Py_NewRef(args[i]));
    }
    for (Py_ssize_t t = 0; t < scan->tensors; t++) PyTuple_SET_ITEM(key, at++, Py_NewRef(scan->dtypes[t]));
    PyObject *alignment;
    if (scan->any_low == 0) {
        alignment = Py_NewRef(Py_True);
    } else {
        alignment = PyTuple_New(scan->tensors);
        if (alignment == NULL) goto fail;
        for (Py_ssize_t t = 0; t < scan->tensors; t++)
            PyTuple_SET_ITEM(alignment, t, Py_NewRef(scan->low_bits[t] == 0 ? Py_True : Py_False));
    }
    PyTuple_SET_ITEM(key, at++, alignment);
    PyTuple_SET_ITEM(key, at++, Py_NewRef(kwnames != NULL ? kwnames : Py_None));
    for (Py_ssize_t k = 0; k < nkw; k++) PyTuple_SET_ITEM(key, at++, Py_NewRef(kwvalues[k]));
    return key;
fail:
    Py_XDECREF(types);
    Py_DECREF(key);
    return NULL;
}

/* The recent-call cache, in front of `kept`: a set-associative table of the calls last launched, each described by
 * words (describe) that a later call matches with one hash of 64-bit words and one memcmp, without building, hashing
 * and comparing the key tuple (the same kernels launch with the same arguments layer after layer;
 * benchmarks/host_instructions.py counted 2-3% fewer host instructions per LayerNorm or attention call, 7% per linear
 * cross entropy forward with its other changes). A description holds what the key holds, exact ints and bools by value
 * and every other object by its address, which is stricter than the key's equality: a match is always the key's match,
 * and a miss (an equal object at another address, a slot another call took) goes on to `kept`. Each slot holds a
 * reference to every object whose address its words hold, so that no address it compares can be reused by another
 * object while it is kept. */
#define RECENT 512        /* slots, a power of two, in sets of WAYS */
#define WAYS 4
typedef uint64_t Word;    /* 64 bits on any host: an int's value never truncated */
#define RECENT_WORDS 160  /* words one description may take: a call with more skips the cache */

typedef struct {
    Py_ssize_t nwords; /* 0: empty */
    unsigned long long used; /* recent_clock when it last served or was kept: the older of a set goes first */
    PyObject *entry;   /* the kept entry the call launched */
    PyObject *held;    /* a tuple of the objects whose addresses words holds */
    Word words[RECENT_WORDS];
} Recent;
static Recent recent[RECENT];
static unsigned long long recent_hits, recent_misses; /* launches the cache served, and the others it saw */
static unsigned long long recent_clock;
static unsigned long long recent_generation; /* recent_clear's count: no slot is kept across one */

/* An int subclass other than bool: its own __eq__ may tell apart what its value does not, so the cache describes
 * it by its address (and holds it) */
static inline int int_subclass(PyObject *o) { return PyLong_Check(o) && !PyLong_CheckExact(o) && !PyBool_Check(o); }

/* o as two words: its type, then its value for an int or a bool that fits 64 bits, its address for anything
 * else (an int subclass too). 0 for an int that does not fit. */
static int object_words(PyObject *o, Word *words) {
    words[0] = (Word)(uintptr_t)Py_TYPE(o);
    if (!PyLong_Check(o) || int_subclass(o)) {
        words[1] = (Word)(uintptr_t)o;
        return 1;
    }
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    words[1] = (Word)value;
    return 1;
}

/* A call's description, the key's parts as words: the kernel, the driver, the device, the argument and constexpr
 * counts, each argument's type with its value (an int: object_words), its dtype's address with the address's
 * alignment bit (a tensor) or nothing (the key holds only the type of anything else), each constexpr's name and
 * value. Returns the number of words, 0 where the call cannot be described (too many words, an int past 64 bits). */
static Py_ssize_t describe(PyObject *kernel, PyObject *device, PyObject *driver, PyObject *const *args,
                           Py_ssize_t nargs, PyObject *kwnames, PyObject *const *kwvalues, Py_ssize_t nkw,
                           const Scan *scan, Word *words) {
    if (7 + 2 * nargs + 3 * nkw > RECENT_WORDS) return 0;
    Py_ssize_t n = 0, t = 0;
    words[n++] = (Word)(uintptr_t)kernel;
    words[n++] = (Word)(uintptr_t)driver;
    if (!object_words(device, words + n)) return 0;
    n += 2;
    words[n++] = (Word)nargs;
    words[n++] = (Word)nkw;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyLong_Check(args[i])) {
            if (!object_words(args[i], words + n)) return 0;
        } else if (t < scan->tensors && scan->tensor_at[t] == i) {
            /* an object's address is a multiple of 8: its lowest bit holds the tensor's alignment */
            words[n] = (Word)(uintptr_t)Py_TYPE(args[i]);
            words[n + 1] = (Word)(uintptr_t)scan->dtypes[t] | (scan->low_bits[t] == 0);
            t++;
        } else {
            words[n] = (Word)(uintptr_t)Py_TYPE(args[i]);
            words[n + 1] = 0;
        }
        n += 2;
    }
    for (Py_ssize_t k = 0; k < nkw; k++) {
        words[n++] = (Word)(uintptr_t)PyTuple_GET_ITEM(kwnames, k);
        if (!object_words(kwvalues[k], words + n)) return 0;
        n += 2;
    }
    return n;
}

/* The call described by words: its slot where the cache holds it (hit set), else the slot of its set to keep it
 * in (an empty one, else the one that served longest ago). WAYS slots a set: the calls of a training step (a few
 * dozen) land in the same set often, and, since the addresses hashed change from run to run, the more calls one set
 * must hold before they push each other out, the rarer a run whose launches keep missing (five of D calls in one of
 * 128 sets: about C(D, 5) / 128^4, 6 in 100,000 runs for 20 calls, 2 in 1,000 for 40). */
static Recent *recent_find(const Word *words, Py_ssize_t n, int *hit) {
    uint64_t hash = 0xcbf29ce484222325ull;
    for (Py_ssize_t i = 0; i < n; i++) {
        hash = (hash ^ words[i]) * 0x100000001b3ull;
        hash ^= hash >> 29;
    }
    Recent *set = &recent[((hash ^ (hash >> 32)) % (RECENT / WAYS)) * WAYS], *oldest = set;
    for (int way = 0; way < WAYS; way++) {
        Recent *slot = &set[way];
        if (slot->nwords == n && memcmp(slot->words, words, n * sizeof(Word)) == 0) {
            *hit = 1;
            slot->used = ++recent_clock;
            return slot;
        }
        if (slot->used < oldest->used) oldest = slot; /* an empty slot's is 0 */
    }
    *hit = 0;
    return oldest;
}

/* Keeps the call described by words in its slot, launching entry; 1 if kept, 0 if not (the cache was cleared, or an
 * argument's type changed, while Python ran here), -1 with an exception set on failure. */
static int recent_keep(Recent *slot, const Word *words, Py_ssize_t n, unsigned long long generation,
                       PyObject *entry, PyObject *kernel, PyObject *device, PyObject *driver, PyObject *const *args,
                       Py_ssize_t nargs, PyObject *kwnames, PyObject *const *kwvalues, Py_ssize_t nkw,
                       const Scan *scan) {
    Py_ssize_t objects = 0; /* int subclasses among the arguments: described by their addresses */
    for (Py_ssize_t i = 0; i < nargs; i++) objects += int_subclass(args[i]);
    PyObject *held = PyTuple_New(3 + nargs + objects + scan->tensors + 3 * nkw);
    if (held == NULL) return -1;
    Py_ssize_t at = 0;
    PyTuple_SET_ITEM(held, at++, Py_NewRef(kernel));
    PyTuple_SET_ITEM(held, at++, Py_NewRef(driver));
    PyTuple_SET_ITEM(held, at++, Py_NewRef(device));
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(held, at++, Py_NewRef((PyObject *)Py_TYPE(args[i])));
        if (int_subclass(args[i]))
            PyTuple_SET_ITEM(held, at++, Py_NewRef(args[i]));
    }
    for (Py_ssize_t t = 0; t < scan->tensors; t++) PyTuple_SET_ITEM(held, at++, Py_NewRef(scan->dtypes[t]));
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyTuple_SET_ITEM(held, at++, Py_NewRef(PyTuple_GET_ITEM(kwnames, k)));
        PyTuple_SET_ITEM(held, at++, Py_NewRef(kwvalues[k]));
        PyTuple_SET_ITEM(held, at++, Py_NewRef((PyObject *)Py_TYPE(kwvalues[k])));
    }
    /* Python may have run since the call was described and its entry found (a finaliser during an allocation, an
     * __eq__ during the lookup): a clear() since then dropped that entry, and a changed __class__ would leave an
     * address in words that held does not hold */
    Word again[RECENT_WORDS];
    if (generation != recent_generation ||
        describe(kernel, device, driver, args, nargs, kwnames, kwvalues, nkw, scan, again) != n ||
        memcmp(again, words, n * sizeof(Word)) != 0) {
        Py_DECREF(held);
        return 0;
    }
    /* the slot is whole before the old contents go: their release may run Python that launches */
    PyObject *old_entry = slot->entry, *old_held = slot->held;
    slot->nwords = 0;
    memcpy(slot->words, words, n * sizeof(Word));
    slot->entry = Py_NewRef(entry);
    slot->held = held;
    slot->used = ++recent_clock;
    slot->nwords = n;
    Py_XDECREF(old_entry);
    Py_XDECREF(old_held);
    return 1;
}

static void recent_clear(void) {
    recent_generation++;
    for (Py_ssize_t i = 0; i < RECENT; i++) {
        Recent *slot = &recent[i];
        PyObject *entry = slot->entry, *held = slot->held;
        slot->nwords = 0;
        slot->used = 0;
        slot->entry = slot->held = NULL;
        Py_XDECREF(entry);
        Py_XDECREF(held);
    }
}

/* Python's path: (what launch returns, the entry to keep or None); the entry is kept under `key`. */
static PyObject *launch_slow(PyObject *kernel, PyObject *grid, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, PyObject *const *kwvalues, Py_ssize_t nkw, PyObject *key) {
    PyObject *arguments = PyTuple_New(nargs), *constexprs = PyDict_New(), *result = NULL, *returned = NULL;
    if (arguments == NULL || constexprs == NULL) goto done;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(arguments, i, args[i]);
    }
    for (Py_ssize_t k = 0; k < nkw; k++) {
        if (PyDict_SetItem(constexprs, PyTuple_GET_ITEM(kwnames, k), kwvalues[k]) < 0) goto done;
    }
    result = PyObject_CallFunctionObjArgs(slow_path, kernel, grid, arguments, constexprs, NULL);
    if (result == NULL) goto done;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "fastbert launch: the Python path must return (result, entry or None)");
        goto done;
    }
    PyObject *entry = PyTuple_GET_ITEM(result, 1);
    if (entry != Py_None &&
        (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 7 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 1)) ||
         !PyTuple_Check(PyTuple_GET_ITEM(entry, 2)) || !PyBool_Check(PyTuple_GET_ITEM(entry, 6)))) {
        PyErr_SetString(PyExc_TypeError, "fastbert launch: an entry is (run, head tuple, tail tuple, grid_meta, "
                                         "compiled, kernel, packs bool)");
        goto done;
    }
    if (entry != Py_None && key != NULL) {
        if (PyDict_GET_SIZE(kept) >= MAX_KEPT) {
            PyDict_Clear(kept);
            recent_clear();
        }
        if (PyDict_SetItem(kept, key, entry) < 0) goto done;
    }
    returned = PyTuple_GET_ITEM(result, 0);
    Py_INCREF(returned);
done:
    Py_XDECREF(result);
    Py_XDECREF(constexprs);
    Py_XDECREF(arguments);
    return returned;
}

/* entry: (run, head tuple, tail tuple, grid_meta, compiled, kernel, packs): run is called with (grid x, y, z,
 * stream, *head, *arguments, *tail), or where packs is True with (grid x, y, z, stream, *head, (*arguments, *tail))
 * (Triton 3.9's C launch, called directly: launch.py's _direct_launch). Returns the compiled kernel launched; NULL
 * with an exception set on an error; NULL without one where the entry cannot launch this call (a grid of other
 * than 1 to 3 dimensions, too many arguments): the caller then takes the Python path, which behaves as Triton. */
static PyObject *launch_kept(PyObject *entry, PyObject *grid, PyObject *device, PyObject *driver,
                             PyObject *const *args, PyObject *const *pointers, Py_ssize_t nargs) {
    PyObject *run = PyTuple_GET_ITEM(entry, 0), *head = PyTuple_GET_ITEM(entry, 1),
             *tail = PyTuple_GET_ITEM(entry, 2), *grid_meta = PyTuple_GET_ITEM(entry, 3);
    PyObject *dims = PyCallable_Check(grid) ? PyObject_CallOneArg(grid, grid_meta) : (Py_INCREF(grid), grid);
    if (dims == NULL) return NULL;
    PyObject *sizes = PySequence_Tuple(dims); /* a tuple of its own: a list grid could change under us */
    Py_DECREF(dims);
    if (sizes == NULL) return NULL;
    Py_ssize_t ndims = PyTuple_GET_SIZE(sizes), nhead = PyTuple_GET_SIZE(head), ntail = PyTuple_GET_SIZE(tail);
    if (ndims < 1 || ndims > 3 || 4 + nhead + nargs + ntail > MAX_ARGS + 16) {
        Py_DECREF(sizes);
        return NULL;
    }
    PyObject *stream = PyObject_CallMethodOneArg(driver, s_get_current_stream, device);
    if (stream == NULL) {
        Py_DECREF(sizes);
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) {
        Py_DECREF(stream);
        Py_DECREF(sizes);
        return NULL;
    }
    PyObject *stack[MAX_ARGS + 16 + 1], *kernel_args = NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t d = 0; d < 3; d++) stack[n++] = d < ndims ? PyTuple_GET_ITEM(sizes, d) : one;
    stack[n++] = stream;
    for (Py_ssize_t i = 0; i < nhead; i++) stack[n++] = PyTuple_GET_ITEM(head, i);
    if (PyTuple_GET_ITEM(entry, 6) == Py_True) { /* the kernel's arguments in one tuple */
        kernel_args = PyTuple_New(nargs + ntail);
        if (kernel_args == NULL) {
            Py_DECREF(one);
            Py_DECREF(stream);
            Py_DECREF(sizes);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < nargs; i++)
            PyTuple_SET_ITEM(kernel_args, i, Py_NewRef(pointers[i] != NULL ? pointers[i] : args[i]));
        for (Py_ssize_t i = 0; i < ntail; i++)
            PyTuple_SET_ITEM(kernel_args, nargs + i, Py_NewRef(PyTuple_GET_ITEM(tail, i)));
        stack[n++] = kernel_args;
    } else {
        for (Py_ssize_t i = 0; i < nargs; i++) stack[n++] = pointers[i] != NULL ? pointers[i] : args[i];
        for (Py_ssize_t i = 0; i < ntail; i++) stack[n++] = PyTuple_GET_ITEM(tail, i);
    }
    PyObject *launched = PyObject_Vectorcall(run, stack, n, NULL);
    Py_XDECREF(kernel_args);
    Py_DECREF(one);
    Py_DECREF(stream);
    Py_DECREF(sizes);
    if (launched == NULL) return NULL;
    Py_DECREF(launched);
    PyObject *compiled = PyTuple_GET_ITEM(entry, 4);
    Py_INCREF(compiled);
    return compiled;
}

static PyObject *launch(PyObject *self, PyObject *const *stack, Py_ssize_t nstack, PyObject *kwnames) {
    if (slow_path == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastbert launch: init() was not called");
        return NULL;
    }
    if (nstack < 2) {
        PyErr_SetString(PyExc_TypeError, "launch(kernel, grid, *args, **constexprs)");
        return NULL;
    }
    PyObject *kernel = stack[0], *grid = stack[1];
    PyObject *const *args = stack + 2;
    Py_ssize_t nargs = nstack - 2, nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *const *kwvalues = stack + nstack;
    int hook = hooked();
    if (hook < 0) return NULL;
    if (hook || nargs > MAX_ARGS) return launch_slow(kernel, grid, args, nargs, kwnames, kwvalues, nkw, NULL);
    PyObject *driver = driver_now();
    if (driver == NULL) return NULL;
    PyObject *pointers[MAX_ARGS];
    for (Py_ssize_t i = 0; i < nargs; i++) pointers[i] = NULL;
    Scan scan;
    scan.tensors = 0;
    Word words[RECENT_WORDS];
    Recent *slot = NULL;
    PyObject *device = PyObject_CallMethodNoArgs(driver, s_get_current_device), *key = NULL, *result = NULL,
             *entry = NULL;
    if (device == NULL || scan_args(args, nargs, pointers, &scan) < 0) goto done;
    Py_ssize_t nwords = describe(kernel, device, driver, args, nargs, kwnames, kwvalues, nkw, &scan, words);
    if (nwords > 0) {
        int hit;
        slot = recent_find(words, nwords, &hit);
        if (hit) entry = Py_NewRef(slot->entry); /* the grid callable or the launcher may run Python that clears it */
    }
    if (entry != NULL) {
        recent_hits++;
    } else {
        recent_misses++;
        unsigned long long generation = recent_generation;
        key = call_key(kernel, device, driver, args, nargs, kwnames, kwvalues, nkw, &scan);
        if (key == NULL) goto done;
        PyObject *found = PyDict_GetItemWithError(kept, key);
        if (found != NULL && PyTuple_GET_ITEM(found, 5) == kernel) {
            entry = Py_NewRef(found);
            if (slot != NULL && recent_keep(slot, words, nwords, generation, entry, kernel, device, driver, args,
                                            nargs, kwnames, kwvalues, nkw, &scan) < 0)
                PyErr_Clear(); /* not kept (no memory for its references): launched all the same */
        } else {
            if (!PyErr_Occurred()) result = launch_slow(kernel, grid, args, nargs, kwnames, kwvalues, nkw, key);
            goto done;
        }
    }
    result = launch_kept(entry, grid, device, driver, args, pointers, nargs);
    if (result == NULL && !PyErr_Occurred()) /* not launchable from the entry: as Triton would */
        result = launch_slow(kernel, grid, args, nargs, kwnames, kwvalues, nkw, NULL);
done:
    for (Py_ssize_t i = 0; i < nargs; i++) Py_XDECREF(pointers[i]);
    scan_release(&scan);
    Py_XDECREF(entry);
    Py_XDECREF(key);
    Py_XDECREF(device);
    Py_DECREF(driver);
    return result;
}

static PyObject *init(PyObject *self, PyObject *args) {
    PyObject *d, *r, *t, *p, *s;
    if (!PyArg_ParseTuple(args, "OOOOO", &d, &r, &t, &p, &s)) return NULL;
    if (!PyType_Check(t) || !PyTuple_Check(p) || PyTuple_GET_SIZE(p) > MAX_PLAIN || !PyCallable_Check(s)) {
        PyErr_SetString(PyExc_TypeError,
                        "init(drivers, runtime knobs, torch.Tensor, plain tensor types tuple, slow path)");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(p); k++) {
        if (!PyType_Check(PyTuple_GET_ITEM(p, k))) {
            PyErr_SetString(PyExc_TypeError, "init: the plain tensor types must be types");
            return NULL;
        }
    }
    Py_XSETREF(drivers, Py_NewRef(d));
    Py_XSETREF(runtime_knobs, Py_NewRef(r));
    PyObject *data_ptr = PyObject_GetAttr(t, s_data_ptr);
    if (data_ptr == NULL) return NULL;
    Py_XSETREF(tensor_type, Py_NewRef(t));
    Py_XSETREF(tensor_data_ptr, data_ptr);
    Py_XSETREF(plain_tensor_types, Py_NewRef(p)); /* keeps the types plain_types points to */
    nplain = PyTuple_GET_SIZE(p);
    for (Py_ssize_t k = 0; k < nplain; k++) plain_types[k] = (PyTypeObject *)PyTuple_GET_ITEM(p, k);
    Py_XSETREF(slow_path, Py_NewRef(s));
    PyDict_Clear(kept); /* entries of an earlier init's kernels */
    recent_clear();
    Py_RETURN_NONE;
}

static PyObject *clear(PyObject *self, PyObject *unused) {
    PyDict_Clear(kept);
    recent_clear();
    Py_RETURN_NONE;
}

static PyObject *kept_count(PyObject *self, PyObject *unused) {
    return PyLong_FromSsize_t(PyDict_GET_SIZE(kept));
}

static PyObject *recent_count(PyObject *self, PyObject *unused) {
    Py_ssize_t filled = 0;
    for (Py_ssize_t i = 0; i < RECENT; i++) filled += recent[i].nwords > 0;
    return Py_BuildValue("nKK", filled, recent_hits, recent_misses);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL | METH_KEYWORDS,
     "launch(kernel, grid, *args, **constexprs): a kept entry's launch, else the Python path's"},
    {"init", init, METH_VARARGS,
     "init(triton.runtime.driver, triton.knobs.runtime, torch.Tensor, plain tensor types, slow_path)"},
    {"clear", clear, METH_NOARGS, "forget every kept entry"},
    {"kept", kept_count, METH_NOARGS, "the number of keys kept"},
    {"recent", recent_count, METH_NOARGS,
     "(calls the recent-call cache holds, launches it served, launches past the hook check it did not)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastbert_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fastbert_launch(void) {
    kept = PyDict_New();
    s_active_attr = PyUnicode_InternFromString("_active");
    s_active = PyUnicode_InternFromString("active");
    s_get_current_device = PyUnicode_InternFromString("get_current_device");
    s_get_current_stream = PyUnicode_InternFromString("get_current_stream");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_enter = PyUnicode_InternFromString("launch_enter_hook");
    s_exit = PyUnicode_InternFromString("launch_exit_hook");
    s_calls = PyUnicode_InternFromString("calls");
    if (kept == NULL || s_active_attr == NULL || s_active == NULL || s_get_current_device == NULL ||
        s_get_current_stream == NULL || s_dtype == NULL || s_data_ptr == NULL || s_enter == NULL ||
        s_exit == NULL || s_calls == NULL)
        return NULL;
    return PyModule_Create(&module);
}
