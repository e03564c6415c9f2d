mod common;
use common::*;

#[test]
fn add_sub_one_request() {
    let s = Server::new();
    s.load(
        "add_sub",
        &add_sub_config("add_sub", "dynamic_batching { }"),
    );
    let r = s.infer(add_sub_request(
        &s,
        "add_sub",
        [1., 2., 3., 4.],
        [10., 20., 30., 40.],
    ));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_f32("OUTPUT0"), vec![11., 22., 33., 44.]);
    assert_eq!(r.output_f32("OUTPUT1"), vec![-9., -18., -27., -36.]);
    let (shape, _) = r.output("OUTPUT0").unwrap();
    assert_eq!(shape, vec![1, 4]);
}
