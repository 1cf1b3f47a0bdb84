"""What a user or SGLang touches first: the plugin entry point, the server checks that refuse
what HiSparse cannot serve, PD decode helpers, the standard-library PD router and the server
launcher the demo and the tests use."""
