"""The simplifier's passes, one small module per pass or pass group. Each pass is
`pass_name(graph, ctx) -> bool`, returning whether it changed the graph."""
