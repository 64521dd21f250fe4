cdef extern from *:
    const char* DISTBELIEF_SOURCE_HASH
SOURCE_HASH = DISTBELIEF_SOURCE_HASH.decode()
