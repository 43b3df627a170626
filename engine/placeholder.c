/* placeholder so the engine library is non-empty until engine sources land */
int kvt__engine_placeholder;
