use tch_dist::Shardable;

#[derive(Shardable)]
union Bits {
    f: f32,
    u: u32,
}

fn main() {}
