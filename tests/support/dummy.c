/* Keeps the test-support library non-empty. */
int kvt__testsupport_dummy;
